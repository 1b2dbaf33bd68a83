"""torch.autocast('neuron', ...): CUDA's autocast policy on the AutocastPrivateUse1 key.

Core PyTorch registers no kernels on AutocastPrivateUse1, so without this module
`torch.autocast('neuron')` around `mm` fails ("Could not run 'aten::mm' ... 'Autocastneuron'").
We register:
- a fallthrough fallback on AutocastPrivateUse1, so ops outside the policy pass through;
- one Python kernel per op in CUDA's policy lists (the op set is the one torch registers on
  AutocastCUDA, see `cuda_autocast_ops`; the policy per op is CUDA's, from aten's autocast_mode.h).

The key is in a tensor's keyset only while autocast('neuron') is enabled (torch excludes it
through TLS otherwise), so these kernels cost nothing outside an autocast region.

Kernels see ops before CompositeImplicit decomposition (the Autocast key sits above Autograd),
so policies are registered on the names CUDA uses (`linear`, `matmul`, `layer_norm`).
`torch.library.register_autocast` cannot be used: it rejects keyword arguments
(`addmm(..., beta=0.5)`), so each kernel casts by hand and redispatches with the key excluded.
"""
from __future__ import annotations

import torch

_KEY = "AutocastPrivateUse1"
_EXCLUDED = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)
_DEVICE_TYPE = "neuron"
# Libraries must outlive register(): dropping one unregisters its kernels.
_libraries: list[torch.library.Library] = []

# CUDA's lists (aten/src/ATen/autocast_mode.h, AT_FORALL_* macros), as registered on AutocastCUDA
# in torch 2.13. Names are "op" or "op.overload".
LOWER_PRECISION_FP = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu",
    "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm",
    "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
)
FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
    "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus",
    "layer_norm", "native_layer_norm", "group_norm", "rms_norm", "frobenius_norm.dim",
    "nuclear_norm", "nuclear_norm.dim", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss",
    "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
    "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d",
    "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)
# fp32 by passing dtype=float32 (when the caller gave none) instead of casting the input.
FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
    "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum",
    "sum.dim_IntList",
)
# fp32 by redispatching to the overload that takes a dtype (norm does not promote on its own).
FP32_APPEND_DTYPE = {
    "norm.Scalar": "ScalarOpt_dtype",
    "norm.ScalarOpt_dim": "ScalarOpt_dim_dtype",
}
PROMOTE = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
    "index_put", "tensordot", "scatter_add",
)
BANNED = ("binary_cross_entropy",)
# On CUDA's list but meaningless here (cuDNN entry points with no host kernel).
NOT_REGISTERED = ("cudnn_convolution", "cudnn_convolution_transpose")

_BCE_BANNED = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast.")


def policy_table() -> dict[str, str]:
    """Every registered op name -> its policy name."""
    table = {}
    for names, policy in ((LOWER_PRECISION_FP, "lower_precision_fp"), (FP32, "fp32"),
                          (FP32_SET_OPT_DTYPE, "fp32_set_opt_dtype"),
                          (tuple(FP32_APPEND_DTYPE), "fp32_append_dtype"),
                          (PROMOTE, "promote"), (BANNED, "banned")):
        table.update(dict.fromkeys(names, policy))
    return table


def cuda_autocast_ops() -> set[str]:
    """The aten ops this torch registers on AutocastCUDA, as "op" / "op.overload"."""
    return {name[len("aten::"):] for name in torch._C._dispatch_get_all_op_names()
            if name.startswith("aten::")
            and torch._C._dispatch_has_kernel_for_dispatch_key(name, "AutocastCUDA")}


# ---- casting (CUDA's cached_cast / promote_type, without the weight-cast cache) ----

def _eligible(t) -> bool:
    return (isinstance(t, torch.Tensor) and t.device.type == "neuron"
            and t.is_floating_point() and t.dtype is not torch.float64)


def _cast(value, dtype):
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if _eligible(value) and value.dtype is not dtype else value
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _cast_all(args, kwargs, dtype):
    return [_cast(a, dtype) for a in args], {k: _cast(v, dtype) for k, v in kwargs.items()}


def _tensors(args, kwargs):
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def _widest(args, kwargs, start):
    dtype = start
    for t in _tensors(args, kwargs):
        if _eligible(t):
            # CUDA errors on bf16 meeting fp16; promote_types gives float32, the safe answer.
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _first_eligible(args, kwargs) -> bool:
    first = args[0] if args else next(iter(kwargs.values()), None)
    return _eligible(first)


# ---- kernels ----

def _make_kernel(op, policy: str):
    if policy == "banned":
        def banned(keyset, *args, **kwargs):
            raise RuntimeError(_BCE_BANNED)
        return banned
    target, prepare = op, _preparer(op, policy)
    if policy == "fp32_append_dtype":
        target, prepare = _append_dtype_target(op)

    def kernel(keyset, *args, **kwargs):
        # As CUDA's WrapFunction: autocast is off for the cast and the call, so inner ops
        # (the decomposition of `linear`, the `_to_copy` casts) are not autocast again.
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDED):
            if not _first_eligible(args, kwargs) and policy.startswith("fp32_"):
                return op(*args, **kwargs)
            args, kwargs = prepare(list(args), dict(kwargs))
            return target(*args, **kwargs)
    kernel.__name__ = f"autocast_{policy}_{op.__name__.replace('.', '_')}"
    return kernel


def _preparer(op, policy: str):
    """A function (args, kwargs) -> (args, kwargs) applying the policy's casts."""
    if policy == "lower_precision_fp":
        return lambda a, k: _cast_all(a, k, torch.get_autocast_dtype(_DEVICE_TYPE))
    if policy == "fp32":
        return lambda a, k: _cast_all(a, k, torch.float32)
    if policy == "promote":
        return lambda a, k: _cast_all(a, k, _widest(a, k, torch.get_autocast_dtype(_DEVICE_TYPE)))
    if policy == "fp32_set_opt_dtype":
        return _set_opt_dtype_preparer(op)
    return None  # fp32_append_dtype: built with its target


def _set_opt_dtype_preparer(op):
    names = [a.name for a in op._schema.arguments]
    pos = names.index("dtype") if "dtype" in names else None
    if pos is None:
        raise AssertionError(f"autocast policy fp32_set_opt_dtype needs a dtype argument, {op} has none")

    def prepare(args, kwargs):
        if pos < len(args):
            if args[pos] is None:
                args[pos] = torch.float32
        elif kwargs.get("dtype") is None:
            kwargs["dtype"] = torch.float32
        return args, kwargs
    return prepare


def _append_dtype_target(op):
    overload = FP32_APPEND_DTYPE[op.__name__.split(".", 1)[0] + "." + op._overloadname]
    target = getattr(torch.ops.aten.norm, overload)
    n_positional = sum(1 for a in target._schema.arguments if not a.kwarg_only)
    names = [a.name for a in op._schema.arguments]

    def prepare(args, kwargs):
        # Fill the target's positional defaults (keepdim=False) the source overload may omit.
        values = dict(zip(names, args), **kwargs)
        values.setdefault("keepdim", False)
        ordered = [values[a.name] for a in target._schema.arguments[:n_positional]]
        return ordered, {"dtype": torch.float32}
    return target, prepare


def _resolve(name: str):
    packet_name, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet_name), overload or "default")


def register(lib) -> None:
    """Install the AutocastPrivateUse1 fallthrough and the per-op policy kernels."""
    fallback_lib = torch.library.Library("_", "IMPL")
    fallback_lib.fallback(torch.library.fallthrough_kernel, _KEY)
    _libraries.append(fallback_lib)
    for name, policy in policy_table().items():
        op = _resolve(name)
        lib.impl(name, _make_kernel(op, policy), _KEY, with_keyset=True)
