"""Ops whose CUDA kernel takes a dtype that CPU's refuses: on neuron they compute what CUDA's does.

The device runs the host's kernels, so an op that CPU's kernel refuses for a dtype fails on
neuron too, even when a program written for accelerators uses that dtype on every device but
cpu and mps. Hugging Face transformers' mixture-of-experts layers (Mixtral, Qwen2-MoE,
Qwen3-MoE with their default grouped_mm experts, transformers/integrations/moe.py) count the
tokens of each expert with `torch.histc` of an int32 tensor off cpu/mps, which CPU's histc
refuses ("histogram_cpu" not implemented for 'Int'): every such model failed on neuron (issue 37).

Here `histc` (and `histc.out`) of a neuron tensor of an integer dtype CUDA's kernel takes
(uint8, int8, int16, int32, int64) computes exactly what CUDA's computes (Note [CUDA's
integer histc]), as one launch (`neuron::histc_integer`, a custom kernel). Every other dtype
still runs the eager path's kernel, CPU's, unchanged (Note [The eager path's kernel, kept]).

The other ops whose CUDA kernel takes dtypes CPU's refuses (OpInfo's dtypesIfCUDA against its
dtypes, torch 2.13) are mostly complex32 (unary math, sum, prod, pow, lerp, convolutions) and
float16/complex32 FFTs, float16/bfloat16 avg_pool3d, multi(label)_margin_loss and
_upsample_bilinear2d_aa, bool abs/softsign/trace, complex nansum/nanmean. No library we know
takes those paths on an accelerator only, so they still give CPU's result or CPU's error on
neuron. KNOWN_CUDA_DTYPE_GAPS below lists each with what neuron does; the test sweep fails on
a gap it does not list, and checks each "cpu" entry gives CPU's value or error.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import Tensor
from torch._prims_common.wrappers import _maybe_resize_out

from .custom_kernels import custom_kernel

# Every OpInfo (name, variant) whose dtypesIfCUDA holds dtypes its dtypes (CPU's) lacks, in
# torch 2.13's op_db, with what neuron does for them: "cuda" (computes CUDA's result, here),
# "cpu" (CPU's kernel runs: CPU's result where it has one, else CPU's error, word for word) or
# "per sequence" (flash-attn's ops: CPU's flash kernel on each sequence, flash_attention.py).
# tests/integrations/test_cuda_dtypes.py sweeps op_db and fails on a gap missing here: a new
# one is a crash waiting on accelerator-only code until someone decides what neuron does.
_C32, _F16, _BF16 = "complex32", "float16", "bfloat16"
_COMPLEX32_ONLY = ("acos", "acosh", "angle", "asin", "asinh", "atan", "atanh", "cos", "cosh", "diag", "exp", "lerp",
                   "log", "logaddexp", "nn.functional.conv1d", "nn.functional.conv2d", "nn.functional.conv3d",
                   "nn.functional.conv_transpose1d", "nn.functional.conv_transpose2d",
                   "nn.functional.conv_transpose3d", "pow", "prod", "rsqrt", "sigmoid", "sin", "sinh", "sqrt", "sum",
                   "tan", "tanh", "true_divide")
KNOWN_CUDA_DTYPE_GAPS: dict[tuple[str, str], tuple[frozenset, str]] = {
    **{(name, ""): (frozenset({_C32}), "cpu") for name in _COMPLEX32_ONLY},
    ("div", "no_rounding_mode"): (frozenset({_C32}), "cpu"),
    **{(f"fft.{name}", ""): (frozenset({_C32, _F16}), "cpu")
       for name in ("fft", "fft2", "fftn", "hfft", "hfft2", "hfftn", "ifft", "ifft2", "ifftn", "irfft", "irfft2",
                    "irfftn")},
    **{(f"fft.{name}", ""): (frozenset({_F16}), "cpu")
       for name in ("ihfft", "ihfft2", "ihfftn", "rfft", "rfft2", "rfftn")},
    ("histc", ""): (frozenset({"uint8", "int8", "int16", "int32", "int64"}), "cuda"),
    ("nanmean", ""): (frozenset({"complex32", "complex64", "complex128"}), "cpu"),
    ("nansum", ""): (frozenset({"complex32", "complex64", "complex128"}), "cpu"),
    ("_upsample_bilinear2d_aa", ""): (frozenset({_F16, _BF16}), "cpu"),
    ("nn.functional.avg_pool3d", ""): (frozenset({_F16, _BF16}), "cpu"),
    ("nn.functional.multi_margin_loss", ""): (frozenset({_F16, _BF16}), "cpu"),
    ("nn.functional.multilabel_margin_loss", ""): (frozenset({_F16, _BF16}), "cpu"),
    ("nn.functional.rrelu", ""): (frozenset({_F16}), "cpu"),
    **{("polygamma", f"polygamma_n_{n}"): (frozenset({_F16}), "cpu") for n in (1, 2, 3, 4)},
    ("round", "decimals_3"): (frozenset({_F16}), "cpu"),
    ("round", "decimals_neg_3"): (frozenset({_F16}), "cpu"),
    ("abs", ""): (frozenset({"bool"}), "cpu"),
    ("nn.functional.softsign", ""): (frozenset({"bool"}), "cpu"),
    ("trace", ""): (frozenset({"bool", _C32}), "cpu"),
    # OpInfo lists no CPU dtypes for these: cuDNN-free batch norm and the memory-efficient
    # attention kernel are CUDA's variants of ops neuron runs through CPU's own paths.
    ("nn.functional.batch_norm", "without_cudnn"): (frozenset({_F16, _BF16, "float32", "float64"}), "cpu"),
    ("torch.ops.aten._efficient_attention_forward", ""): (frozenset({_F16, "float32"}), "cpu"),
    # varlen_attn's op (torchtitan): CPU's flash kernel runs on each sequence.
    ("torch.ops.aten._flash_attention_forward", ""): (frozenset({_F16}), "per sequence"),
}

# AT_DISPATCH_ALL_TYPES of `_histc_cuda`, less its floating types (CPU's kernel has those).
CUDA_INTEGER_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})
_INT64_MIN, _INT64_MAX = -(2 ** 63), 2 ** 63 - 1

# Note [CUDA's integer histc] (aten/src/ATen/native/cuda/SummaryOps.cu, torch 2.13):
# - `_histc_cuda` converts min and max with `Scalar::to<bounds_t>`, bounds_t being
#   `acc_type<scalar_t, /*is_cuda=*/true>`: int64_t for every integer dtype. The conversion is
#   checked: a float bound truncates toward zero, a NaN or one int64 cannot hold raises.
# - `_histc_cuda_template`: bins <= 0 raises; the output is zeros({nbins}) of the input's dtype;
#   if min == max (as int64) and the input has elements, the bounds become `self.aminmax()`
#   (read on the host); if still equal, min - 1 and max + 1; then
#   TORCH_CHECK(minvalue < maxvalue, "max must be larger than min").
# - `kernelHistogram1D`, for every element bVal, in any layout: counted only if
#   `bVal >= minvalue && bVal <= maxvalue`, into bin
#   `(int)(((bVal - minvalue)) * nbins / (maxvalue - minvalue))`, int64 arithmetic with integer
#   division; `if (bin == nbins) bin -= 1` (the last bin is closed, so max itself counts).
# - The counts are `gpuAtomicAddNoReturn` of 1 in the input's dtype: integer adds, which wrap
#   modulo 2^bits and do not depend on order (torch alerts nondeterminism for floating inputs only).
# Where (max - min) * bins does not fit in int64 (int64 inputs only), or bins exceeds an int,
# CUDA's bin arithmetic overflows into undefined behaviour: the device refuses instead.


def _int64_bound(value) -> int:
    """c10's `Scalar::to<int64_t>`: a float truncates toward zero; NaN, an infinity or a value
    outside int64 raises as c10's checked conversion does."""
    if isinstance(value, (bool, int)):
        return int(value)
    if isinstance(value, complex) or not math.isfinite(value) or not -(2.0 ** 63) <= value < 2.0 ** 63:
        raise RuntimeError("value cannot be converted to type int64_t without overflow")
    return int(value)


def _check_bin_arithmetic(bins: int, lo: int, hi: int) -> None:
    if bins > 2 ** 31 - 1 or (hi - lo) * bins > _INT64_MAX or lo < _INT64_MIN or hi > _INT64_MAX:
        raise RuntimeError(
            f"histc of an integer tensor on neuron computes CUDA's bins, (x - min) * bins / (max - min) in "
            f"int64, which overflows for bins={bins} over [{lo}, {hi}] (undefined on CUDA). Use fewer bins, "
            f"a narrower [min, max], or a float tensor.")


def _histc_integer_fake(input: Tensor, bins: int, min: int, max: int) -> Tensor:
    return input.new_empty((bins,))


@custom_kernel("neuron::histc_integer", schema="(Tensor input, int bins, int min, int max) -> Tensor",
               fake=_histc_integer_fake)
def histc_integer(input: Tensor, bins: int, min: int, max: int) -> Tensor:
    """CUDA's `histc` of an integer tensor (Note [CUDA's integer histc]), bounds already int64."""
    values = input.reshape(-1).to(torch.int64)
    lo, hi = min, max
    if lo == hi and values.numel() > 0:
        lo, hi = (int(t) for t in torch.aminmax(values))  # the data's range, as CUDA reads it
    if lo == hi:
        lo, hi = lo - 1, hi + 1
    _check_bin_arithmetic(bins, lo, hi)
    # Clamped first, so an element outside [lo, hi] (dropped below) cannot overflow; inside, the
    # numerator is >= 0, where floor division is C++'s truncating one.
    bin_of = (values.clamp(lo, hi) - lo).mul_(bins).div_(hi - lo, rounding_mode="floor")
    bin_of.masked_fill_(bin_of == bins, bins - 1)
    bin_of.masked_fill_((values < lo) | (values > hi), bins)  # a spare bin, dropped
    counts = torch.bincount(bin_of, minlength=bins + 1)[:bins]
    return counts.to(input.dtype, copy=True)  # wraps modulo 2^bits, as CUDA's integer atomics


def _cuda_histc_arguments(bins: int, min, max) -> tuple[int, int, int]:
    """(bins, min, max) as `_histc_cuda` takes them, with the errors it raises before reading data."""
    lo, hi = _int64_bound(min), _int64_bound(max)
    if bins <= 0:
        raise RuntimeError("bins must be > 0")
    if lo != hi:  # equal bounds become the data's range, which is never empty
        if not lo < hi:
            raise RuntimeError("max must be larger than min")
        _check_bin_arithmetic(bins, lo, hi)
    return bins, lo, hi


def _histc(eager_kernel, keyset, self, bins=100, min=0, max=0):
    if self.dtype not in CUDA_INTEGER_DTYPES:
        return eager_kernel.call_boxed(keyset, self, bins, min, max)
    return histc_integer(self, *_cuda_histc_arguments(bins, min, max))


def _histc_out(eager_kernel, keyset, self, bins=100, min=0, max=0, *, out):
    if self.dtype not in CUDA_INTEGER_DTYPES:
        return eager_kernel.call_boxed(keyset, self, bins, min, max, out=out)
    result = histc_integer(self, *_cuda_histc_arguments(bins, min, max))
    # `_histc_out_cuda`: resize_output(result, ret.sizes()); result.copy_(ret)
    _maybe_resize_out(out, result.shape)
    return out.copy_(result)


def register(lib: torch.library.Library) -> None:
    """Route histc of integer neuron tensors to CUDA's computation; call after the eager path is installed."""
    for name, kernel in (("histc", _histc), ("histc.out", _histc_out)):
        # Note [The eager path's kernel, kept]: the kernel PrivateUse1 computes for this op now is
        # the eager path's fallback (csrc/aten/registration.cpp), which runs CPU's kernel. Read
        # here, after install_eager and before our impl replaces it (read after, it would be
        # this Python kernel, calling itself), it is what every other dtype keeps running: the
        # same boxed C++ kernel, routed, deferred and priced as before. The eager path and the
        # adaptive queue redispatch an op at PrivateUse1 to run it on the device thread, which
        # reaches this kernel again there (the issuing thread waits without the GIL), and it
        # hands the op to the fallback again, which then runs CPU's kernel.
        eager_kernel = torch.library.get_kernel(f"aten::{name}", "PrivateUse1")
        lib.impl(name, functools.partial(kernel, eager_kernel), "PrivateUse1", with_keyset=True)
