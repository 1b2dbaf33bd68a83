"""histc of an integer neuron tensor computes CUDA's result (dispatch/cuda_dtypes.py, issue 37).

CPU's histc refuses integers; CUDA's takes them, and Hugging Face's mixture-of-experts layers
count tokens per expert with an int32 histc on every device but cpu and mps. Each case is
checked against a line-by-line transcription of CUDA's kernel (Note [CUDA's integer histc])
in Python integers, and, where the two provably agree, against CPU's own float64 histc.
Floating inputs keep the eager path's kernel: CPU's values, errors and route.
"""
from __future__ import annotations

import pytest
import torch

import adaptive_eager
from adaptive_eager.device import native

INTEGER_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
_BITS = {torch.uint8: 8, torch.int8: 8, torch.int16: 16, torch.int32: 32, torch.int64: 64}


def _wrap(count: int, dtype: torch.dtype) -> int:
    """An integer atomic add's result: the count modulo 2^bits, in the dtype's range."""
    bits = _BITS[dtype]
    count %= 2 ** bits
    signed = dtype != torch.uint8
    return count - 2 ** bits if signed and count >= 2 ** (bits - 1) else count


def cuda_histc_reference(x: torch.Tensor, bins: int, min_value, max_value) -> torch.Tensor:
    """SummaryOps.cu's `_histc_cuda` for an integer tensor, transcribed with Python ints."""
    lo, hi = int(min_value), int(max_value)  # Scalar::to<int64_t>: toward zero
    values = [int(v) for v in x.reshape(-1).tolist()]
    if lo == hi and values:
        lo, hi = min(values), max(values)
    if lo == hi:
        lo, hi = lo - 1, hi + 1
    counts = [0] * bins
    for v in values:
        if lo <= v <= hi:
            b = (v - lo) * bins // (hi - lo)  # numerator >= 0: floor is C++'s truncation
            if b == bins:
                b -= 1
            counts[b] += 1
    return torch.tensor([_wrap(c, x.dtype) for c in counts], dtype=x.dtype)

# name -> (values, bins, min, max): every element in range of every dtype once cast (uint8 gets
# the absolute values)
CASES = {
    "moe_counts": ([3, 0, 1, 3, 3, 2, 0, 1, 1, 3], 4, 0, 3),  # transformers': bins=E, [0, E-1]
    "outside_range_dropped": ([-5, 0, 1, 2, 7, 9, 100, 4], 3, 1, 7),
    "negative_values": ([-8, -7, -3, -1, 0, 2, -8, -4], 5, -8, 2),
    "data_range_when_min_eq_max_eq_0": ([5, 9, 6, 12, 12, 7], 4, 0, 0),
    "data_range_when_min_eq_max": ([-3, 4, 1, 1, 2], 3, 6, 6),
    "constant_data_widened_by_one": ([4, 4, 4], 3, 0, 0),
    "more_bins_than_range": ([0, 1, 2, 2], 10, 0, 2),
    "range_not_a_multiple_of_bins": ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 3, 0, 10),
    "float_bounds_truncate_toward_zero": ([0, 1, 2, 3, 4], 4, 0.9, 3.7),
    "empty": ([], 5, 0, 0),
}


def _input(values, dtype):
    t = torch.tensor(values, dtype=torch.int64)
    return (t.abs() if dtype == torch.uint8 else t).to(dtype)


def _float64_reference_applies(x, min_value, max_value) -> bool:
    """CPU's float64 histc bins an element at (x - lo) * bins / (hi - lo), rounded once. With
    integer bounds and (x - lo) * bins below 2^53, the exact quotient is an integer or at least
    1 / (hi - lo) below the next one, more than that rounding moves it: the bin is CUDA's."""
    small = x.numel() == 0 or x.abs().max().item() < 2 ** 20
    return small and float(min_value).is_integer() and float(max_value).is_integer()


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
@pytest.mark.parametrize("dtype", INTEGER_DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_integer_histc_is_cudas(case, dtype, mode):
    values, bins, lo, hi = CASES[case]
    x = _input(values, dtype)
    expected = cuda_histc_reference(x, bins, lo, hi)
    if _float64_reference_applies(x, lo, hi):
        assert torch.equal(expected, torch.histc(x.double(), bins, lo, hi).to(dtype)), "the references disagree"
    xn = x.to("neuron")
    with adaptive_eager.mode(mode):
        got = [torch.histc(xn, bins=bins, min=lo, max=hi) for _ in range(5)]  # adaptive: recorded, then replayed
    for g in got:
        assert g.device.type == "neuron" and g.dtype == dtype
        assert torch.equal(g.cpu(), expected), (g.cpu(), expected)


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
def test_a_deferred_integer_input_and_a_strided_one(mode):
    x = torch.randint(-20, 20, (6, 8), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    expected_t = cuda_histc_reference(x.t(), 7, -15, 15)
    expected_data_range = cuda_histc_reference(x + 1, 6, 0, 0)
    xn = x.to("neuron")
    with adaptive_eager.mode(mode):
        for _ in range(5):
            strided = torch.histc(xn.t(), bins=7, min=-15, max=15)
            deferred = torch.histc(xn + 1, bins=6)  # its input's bytes written by a launch before it
            assert torch.equal(strided.cpu(), expected_t)
            assert torch.equal(deferred.cpu(), expected_data_range)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8])
def test_counts_wrap_in_the_inputs_dtype_as_cudas_integer_atomics(dtype):
    x = torch.zeros(300, dtype=dtype)
    got = torch.histc(x.to("neuron"), bins=2, min=0, max=1).cpu()
    assert got.tolist() == [300 - 256, 0]
    assert torch.equal(got, cuda_histc_reference(x, 2, 0, 1))


def test_integer_histc_in_grad_modes_and_out_variant():
    x = torch.tensor([0, 2, 2, 5, 9], dtype=torch.int32)
    expected = cuda_histc_reference(x, 3, 0, 9)
    xn = x.to("neuron")
    with torch.inference_mode():  # no autograd key: the PrivateUse1 kernel itself
        assert torch.equal(torch.histc(xn, bins=3, min=0, max=9).cpu(), expected)
    with torch.no_grad():
        assert torch.equal(torch.ops.aten.histc.default(xn, 3, 0, 9).cpu(), expected)
    out = torch.empty(0, dtype=torch.int32, device="neuron")
    assert torch.histc(xn, bins=3, min=0, max=9, out=out) is out
    assert torch.equal(out.cpu(), expected)
    with pytest.warns(UserWarning, match="was resized"):  # as resize_output warns
        torch.histc(xn, bins=3, min=0, max=9, out=torch.zeros(5, dtype=torch.int32, device="neuron"))


@pytest.mark.parametrize("call, message", [
    (lambda x: torch.histc(x, bins=0), "bins must be > 0"),
    (lambda x: torch.histc(x, bins=3, min=4, max=1), "max must be larger than min"),
    (lambda x: torch.histc(x, bins=3, min=0, max=float("inf")), "cannot be converted to type int64_t"),
    (lambda x: torch.histc(x, bins=3, min=float("nan"), max=2), "cannot be converted to type int64_t"),
    (lambda x: torch.histc(x, bins=2 ** 40, min=-(2 ** 62), max=2 ** 62), "overflows"),
])
def test_integer_histc_raises_where_cudas_does_or_would_overflow(call, message):
    x = torch.tensor([1, 2, 3], dtype=torch.int64, device="neuron")
    with pytest.raises(RuntimeError, match=message):
        call(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_float_histc_keeps_the_eager_paths_kernel(dtype):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    expected = torch.histc(x, bins=13, min=-2, max=2.5)
    xn = x.to("neuron")
    with adaptive_eager.mode("eager"):
        adaptive_eager.reset_stats()
        native.set_op_log(True)
        got = torch.histc(xn, bins=13, min=-2, max=2.5)
        ops = [name for name, _ in native.take_op_log()]
        native.set_op_log(False)
        assert adaptive_eager.stats().launches == 1
    assert ops == ["aten::histc"]  # priced by the eager path: its C++ fallback ran it, as before
    assert torch.equal(got.cpu(), expected)
    out = torch.empty(0, dtype=dtype, device="neuron")
    torch.histc(xn, bins=13, min=-2, max=2.5, out=out)
    assert torch.equal(out.cpu(), expected)
    grad_input = xn.float().requires_grad_()
    assert not torch.histc(grad_input, bins=4).requires_grad  # not differentiable, as on CPU
    with adaptive_eager.mode("adaptive"):  # deferred and replayed: the fallback run on the device thread
        got = [torch.histc(xn * 1, bins=13, min=-2, max=2.5) * 1 for _ in range(6)]
    assert all(torch.equal(g.cpu(), expected) for g in got)


def test_integer_histc_is_one_launch_of_its_own_kernel():
    xn = torch.tensor([0, 1, 2, 2], dtype=torch.int32, device="neuron")
    with adaptive_eager.mode("eager"):
        adaptive_eager.reset_stats()
        native.set_op_log(True)
        torch.histc(xn, bins=3, min=0, max=2)
        ops = native.take_op_log()
        native.set_op_log(False)
        assert adaptive_eager.stats().launches == 1
    assert ops == []  # priced in Python, as a custom kernel: not the eager path's aten::histc


def test_other_dtypes_still_give_cpus_error():
    x = torch.tensor([True, False])
    with pytest.raises(RuntimeError) as on_cpu:
        torch.histc(x, bins=2)
    with pytest.raises(RuntimeError) as on_neuron:
        torch.histc(x.to("neuron"), bins=2)
    assert str(on_neuron.value) == str(on_cpu.value)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("backend", ["neuron", "inductor"])
def test_integer_histc_under_torch_compile(backend):
    def program(x):
        return torch.histc((x + 1).int(), bins=4, min=0, max=3) * 2

    x = torch.tensor([0, 1, 2, 2, -1, 5, 3])
    expected = cuda_histc_reference((x + 1).int(), 4, 0, 3) * 2
    got = torch.compile(program, backend=backend)(x.to("neuron"))
    assert got.device.type == "neuron" and torch.equal(got.cpu(), expected)


# -- a real client: Qwen3-MoE with its default experts (grouped_mm) -----------------------------

VOCAB = 64


def _qwen3_moe(transformers):
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=32, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=1))


def _train(transformers, device, mode, steps):
    with adaptive_eager.mode(mode):
        torch.manual_seed(0)
        model = _qwen3_moe(transformers).to(device).train()
        assert model.config._experts_implementation == "grouped_mm"  # the default: histc counts the tokens
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(steps):
            ids = torch.randint(0, VOCAB, (2, 12), generator=g).to(device)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}


# adaptive: from the fourth step the whole step is a replayed trace, histc inside it
@pytest.mark.parametrize("mode, steps", [("eager", 3), ("adaptive", 6)])
def test_qwen3_moe_default_experts_train_bitwise_as_on_cpu(mode, steps, monkeypatch):
    """Bitwise CPU's, although CPU counts with histc of a float32 tensor and neuron, as CUDA,
    of an int32 one: the expert ids are integers in [0, E-1] with bins=E, min=0, max=E-1, where
    CPU's float32 bin, floor(x * E / (E - 1)) rounded once, equals CUDA's integer one (the
    quotient is at least 1/(E-1) from the next integer, far above float32's rounding for any
    realistic E); both counts are exact, and become the same int32 offsets (cumsum, dtype=int32),
    the only use transformers makes of them. Every later op then sees identical inputs."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    calls = []
    histc = torch.histc

    def spy(input, *args, **kwargs):
        calls.append((input.device.type, input.dtype))
        return histc(input, *args, **kwargs)

    monkeypatch.setattr(torch, "histc", spy)
    cpu_losses, cpu_state = _train(transformers, "cpu", "eager", steps)
    assert set(calls) == {("cpu", torch.float32)}
    calls.clear()
    losses, state = _train(transformers, "neuron", mode, steps)
    assert set(calls) == {("neuron", torch.int32)}  # CUDA's path, which failed before issue 37
    assert losses == cpu_losses
    assert len(set(cpu_losses)) > 1, "the loss never moved: comparing it proves nothing"
    differ = [k for k in cpu_state if not torch.equal(cpu_state[k], state[k])]
    assert not differ, f"{len(differ)} of {len(cpu_state)} tensors differ from CPU's, first {differ[:3]}"



# -- the sweep: every op whose CUDA kernel takes a dtype CPU's refuses (issue 37, item 7) -------

def _cuda_dtype_gaps() -> dict:
    """(name, variant) -> the dtypes OpInfo says CUDA's kernel takes and CPU's does not."""
    from torch.testing._internal.common_methods_invocations import op_db

    gaps = {}
    for op in op_db:
        missing = set(op.dtypesIfCUDA) - set(op.dtypes)
        if missing:
            gaps[(op.name, op.variant_test_name)] = frozenset(str(d).removeprefix("torch.") for d in missing)
    return gaps


def test_no_op_takes_a_dtype_on_cuda_that_neuron_has_not_decided_about():
    """A gap not in KNOWN_CUDA_DTYPE_GAPS is a crash waiting on code written for accelerators
    (as integer histc was for every HF mixture-of-experts model): decide what neuron does for
    it, compute CUDA's result or keep CPU's error, and list it there."""
    from adaptive_eager.dispatch.cuda_dtypes import KNOWN_CUDA_DTYPE_GAPS

    gaps = _cuda_dtype_gaps()
    assert ("histc", "") in gaps  # the sweep sees the gap it was written for: else it could not fail
    new = {key: sorted(dtypes - KNOWN_CUDA_DTYPE_GAPS.get(key, (frozenset(), ""))[0])
           for key, dtypes in gaps.items()}
    new = {key: dtypes for key, dtypes in new.items() if dtypes}
    assert not new, f"ops whose CUDA kernel takes dtypes CPU's refuses, undecided on neuron: {new}"


def _cpu_gap_cases():
    from adaptive_eager.dispatch.cuda_dtypes import KNOWN_CUDA_DTYPE_GAPS
    from torch.testing._internal.common_methods_invocations import op_db

    by_key = {(op.name, op.variant_test_name): op for op in op_db}
    return [pytest.param(by_key[key], dtype, id=f"{key[0]}.{key[1]}-{dtype}" if key[1] else f"{key[0]}-{dtype}")
            for key, (dtypes, does) in sorted(KNOWN_CUDA_DTYPE_GAPS.items())
            if does == "cpu" and key in by_key for dtype in sorted(dtypes)]


def _outcome(op, sample):
    try:
        return "value", op(sample.input, *sample.args, **sample.kwargs)
    except Exception as e:  # noqa: BLE001: CPU's error, whatever its type, is the expected one
        return "error", (type(e), str(e).split("\n")[0])


@pytest.mark.parametrize("op, dtype", _cpu_gap_cases())
def test_a_dtype_only_cuda_takes_gives_cpus_result_or_cpus_error_on_neuron(op, dtype):
    """Where neuron keeps CPU's kernel, the first OpInfo sample in that dtype gives CPU's
    value, or CPU's error type with CPU's message or one of neuron's own that names the op
    (an op CPU has no kernel for at all, as CUDA's fused attention kernels)."""
    from torch.utils._pytree import tree_map

    torch_dtype = getattr(torch, dtype)
    samples = op.sample_inputs("cpu", torch_dtype, requires_grad=False)
    sample = next(iter(samples), None)
    if sample is None:
        pytest.skip(f"OpInfo has no {dtype} sample for {op.name}")
    on_neuron = sample.transform(lambda t: t.to("neuron") if isinstance(t, torch.Tensor) else t)
    kind, cpu = _outcome(op, sample)
    neuron_kind, neuron = _outcome(op, on_neuron)
    assert neuron_kind == kind, f"CPU gave {kind} {cpu if kind == 'error' else ''}, neuron {neuron_kind} {neuron}"
    if kind == "error":
        assert neuron[0] is cpu[0] or issubclass(neuron[0], cpu[0]), (cpu, neuron)
        same_words = neuron[1].replace("neuron", "cpu") == cpu[1].replace("neuron", "cpu")
        assert same_words or ("neuron" in neuron[1] and op.name.split(".")[-1] in neuron[1]), (cpu, neuron)
    else:
        got = tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, neuron)
        same = tree_map(lambda a, b: _same_values(a, b) if isinstance(a, torch.Tensor) else a == b, cpu, got)
        assert all(torch.utils._pytree.tree_leaves(same)), (cpu, got)


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN where NaN (CPU has no comparison kernels for complex32: widened)."""
    if a.dtype == torch.complex32:
        a, b = a.to(torch.complex64), b.to(torch.complex64)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    return bool(((a == b) | (a.isnan() & b.isnan())).all()) if a.is_floating_point() else torch.equal(a, b)
