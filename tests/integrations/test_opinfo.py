"""Op coverage against PyTorch's own OpInfo database: every op gives the CPU result on neuron.

For each OpInfo we take up to SAMPLES_PER_OP samples, run them on CPU, then run the same
samples with every tensor moved to `neuron` (and a `device='cpu'` argument pointed at
neuron, for factories), compare the results, and check every output tensor is on neuron.
Ops whose samples do not run on CPU say nothing about us: they are skipped and counted
apart. Known failures live in tests/opinfo_expected_failures.py, each with the cause, and
are strict xfails, so a fix shows up as an XPASS to remove from the table.

Runs (see RUNS): the function variant in float32 (the headline sweep) and complex64
(conj/neg views), and in float32 the in-place variant (must return its input, written)
and the out= variant (into empty(0) tensors, so the result must follow the resize), and
the backward run: the gradients of every input with fixed cotangents, bit for bit CPU's
(ops whose CPU kernel is not their composite, silu_backward say, gave other bits once).

`test_opinfo_pass_rate` prints "OpInfo: N of M ops whose CPU samples run pass on neuron"
per run at the end of the session and holds each rate at or above MIN_PASS_RATE.
"""
from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("expecttest")  # common_methods_invocations imports it
from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402

from opinfo_expected_failures import CRASHES, EXPECTED_FAILURES, NONDETERMINISTIC  # noqa: E402

SAMPLES_PER_OP = 3
MIN_PASS_RATE = 0.95
NEURON = torch.device("neuron")

# Ops that draw random numbers (from the device's generator on neuron, the CPU one on CPU):
# only shapes, dtypes and devices can be compared. OpInfo's has_nondeterministic_output
# (uninitialised memory: empty, new_empty...) is honoured as well.
RANDOM_OPS = frozenset({
    "bernoulli", "cauchy", "exponential", "geometric", "log_normal", "multinomial",
    "normal", "normal.in_place", "normal.number_mean", "uniform",
    "rand_like", "randn", "randn_like", "randint", "randint_like",
    "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
    "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout.with_train",
    "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d",
    "nn.functional.rrelu",
})


def full_name(op) -> str:
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


OPS = {full_name(op): op for op in op_db}


class CpuSamplesDoNotRun(Exception):
    """The op's own samples fail on CPU: a property of the CPU build, not of neuron."""


# -- moving a sample to the device ---------------------------------------------------------
def _is_cpu_device(x) -> bool:
    return (isinstance(x, str) and x == "cpu") or (isinstance(x, torch.device) and x.type == "cpu")


def to_neuron(x):
    """The same value with every tensor on neuron and every `cpu` device argument made neuron."""
    if isinstance(x, torch.Tensor):
        return _tensor_to_neuron(x)
    if _is_cpu_device(x):
        return NEURON
    if isinstance(x, (list, tuple)):
        return type(x)(to_neuron(e) for e in x)
    if isinstance(x, dict):
        return {k: to_neuron(v) for k, v in x.items()}
    return x


def _tensor_to_neuron(x: torch.Tensor) -> torch.Tensor:
    """x on neuron with the same strides and storage offset: views (samples that are slices
    of a larger buffer, expanded or transposed tensors) are moved with their whole storage
    and viewed again, so ops that read the layout (as_strided) see what they see on CPU."""
    requires_grad = x.requires_grad  # a leaf on neuron as on CPU (the backward run)
    x = x.detach()
    if x.layout != torch.strided or _is_compact(x):
        return x.to(NEURON).requires_grad_(requires_grad)
    whole = x.as_strided((x.untyped_storage().nbytes() // x.element_size(),), (1,), 0).to(NEURON)
    return whole.as_strided(x.shape, x.stride(), x.storage_offset()).detach().requires_grad_(requires_grad)


def _is_compact(x: torch.Tensor) -> bool:
    return (x.is_contiguous() and x.storage_offset() == 0
            and x.untyped_storage().nbytes() == x.numel() * x.element_size())


def to_host_checked(x, where: str = "output"):
    """Neuron outputs copied to CPU; any output tensor that is not on neuron is an error."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "neuron":
            raise AssertionError(f"{where} is on {x.device}, expected a neuron tensor")
        return x.cpu()
    if isinstance(x, (list, tuple)):
        return type(x)(to_host_checked(e, f"{where}[{i}]") for i, e in enumerate(x))
    return x


def _metadata(x):
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.dtype)
    if isinstance(x, (list, tuple)):
        return [_metadata(e) for e in x]
    return type(x)


# -- running one op --------------------------------------------------------------------------
# -- the variants --------------------------------------------------------------------------
def _same(x):
    return x


def _empty_like_outputs(template, move):
    """out= tensors shaped like nothing (empty(0)): the op must resize them."""
    if isinstance(template, torch.Tensor):
        return move(torch.empty(0, dtype=template.dtype))
    return type(template)(_empty_like_outputs(t, move) for t in template)


def _tensors(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for e in x for t in _tensors(e)]
    if isinstance(x, dict):
        return [t for e in x.values() for t in _tensors(e)]
    return []


def _cotangent(t: torch.Tensor) -> torch.Tensor:
    """A fixed cotangent for output t, the same on every device (made on the CPU)."""
    g = torch.Generator().manual_seed(t.numel())
    return torch.randn(t.shape, generator=g, dtype=t.dtype)


def backward(op, sample, move):
    """The gradients of every floating input that requires grad, after backward through the
    function variant's floating outputs with fixed cotangents; None where an input got none."""
    inputs = move(sample.input), move(sample.args), move(sample.kwargs)
    out = op(inputs[0], *inputs[1], **inputs[2])
    outs = [t for t in _tensors(out) if t.requires_grad and t.dtype.is_floating_point]
    if not outs:
        raise CpuSamplesDoNotRun("no output requires grad")
    leaves = [t for t in _tensors(inputs) if t.requires_grad]
    grads = torch.autograd.grad(outs, leaves, [move(_cotangent(t)) for t in outs], allow_unused=True)
    return list(grads)


def call(variant: str, op, sample, move, template=None):
    """Run one sample of one variant on the device `move` puts tensors on (_same: CPU).
    template is the function variant's CPU result (out= needs its dtypes)."""
    if variant == "backward":
        return backward(op, sample, move)
    args, kwargs = move(sample.args), move(sample.kwargs)
    if variant == "inplace":
        x = move(sample.input)
        x = x.clone() if x is sample.input else x  # the CPU run must not write the sample
        if op.inplace_variant(x, *args, **kwargs) is not x:
            raise AssertionError("the in-place variant did not return its input")
        return x
    if variant == "out":
        out = _empty_like_outputs(template, move)
        op(move(sample.input), *args, **kwargs, out=out)
        return out
    return op(move(sample.input), *args, **kwargs)


def _has_variant(op, variant: str) -> bool:
    if variant == "backward":
        return op.supports_autograd
    if variant == "inplace":
        return op.inplace_variant is not None
    if variant == "out":
        return op.supports_out
    return True


def cpu_samples(op, variant: str, dtype):
    """Up to SAMPLES_PER_OP samples with their CPU results."""
    if not _has_variant(op, variant):
        raise CpuSamplesDoNotRun(f"the op has no {variant} variant")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            samples = []
            for s in op.sample_inputs("cpu", dtype, requires_grad=variant == "backward"):
                if variant == "inplace" and s.broadcasts_input:
                    continue  # in-place cannot broadcast its input: an error on any device
                template = op(s.input, *s.args, **s.kwargs) if variant == "out" else None
                samples.append((s, call(variant, op, s, _same, template), template))
                if len(samples) == SAMPLES_PER_OP:
                    break
    except Exception as e:  # any failure of the op's own CPU run
        raise CpuSamplesDoNotRun(f"{type(e).__name__}: {e}") from e
    if not samples:
        raise CpuSamplesDoNotRun(f"no {dtype} samples for the {variant} variant")
    return samples


def check_op_on_neuron(op, variant: str, dtype) -> None:
    """Run each CPU sample on neuron and compare; raises on the first mismatch."""
    random = full_name(op) in RANDOM_OPS or op.name in RANDOM_OPS or op.has_nondeterministic_output
    for i, (sample, expected, template) in enumerate(cpu_samples(op, variant, dtype)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = call(variant, op, sample, to_neuron, template)
        actual = to_host_checked(out)
        if random:
            assert _metadata(actual) == _metadata(expected), f"sample {i}: {sample}"
        elif variant == "backward":  # bitwise: the same kernels, forward and backward, as CPU's
            for k, (a, e) in enumerate(zip(actual, expected)):
                assert (a is None) == (e is None), f"sample {i}: gradient {k} is {a} on neuron, {e} on CPU"
                if a is not None:  # equal bit for bit, NaNs where CPU has them
                    torch.testing.assert_close(a, e, rtol=0, atol=0, equal_nan=True,
                                               msg=lambda m: f"sample {i}: gradient {k}: {m}\n{sample}")
        else:
            torch.testing.assert_close(actual, expected, equal_nan=True, msg=lambda m: f"sample {i}: {m}\n{sample}")


# -- pytest wiring ---------------------------------------------------------------------------
# run name -> (variant, dtype). "function-float32" is the headline sweep; complex64 is there
# because conj/neg views are flags the Python dispatch path can silently drop, and no
# float32 sample builds them except fft.hfftn.
RUNS = {
    "function-float32": ("function", torch.float32),
    "function-complex64": ("function", torch.complex64),
    "inplace-float32": ("inplace", torch.float32),
    "out-float32": ("out", torch.float32),
    # the gradients of every input, bitwise CPU's (issue 12: composites CPU does not take)
    "backward-float32": ("backward", torch.float32),
}
RESULTS: dict[tuple[str, str], str] = {}  # (run, op name) -> "pass" | "fail" | "cpu"


def run_and_record(run: str, name: str) -> None:
    key = (run, name)
    try:
        check_op_on_neuron(OPS[name], *RUNS[run])
    except CpuSamplesDoNotRun:
        RESULTS[key] = "cpu"
        raise
    except Exception:
        RESULTS[key] = "fail"
        raise
    RESULTS[key] = "pass"


def table_entry(table: dict, run: str, name: str):
    """An entry for this run ("out-float32:name"), this variant ("out:name") or every run ("name")."""
    variant = RUNS[run][0]
    return table.get(f"{run}:{name}") or table.get(f"{variant}:{name}") or table.get(name)


def _param(run: str, name: str):
    crash = table_entry(CRASHES, run, name)
    if crash is not None:
        return pytest.param(run, name, marks=pytest.mark.skip(reason=f"crashes the process: {crash}"))
    unknowable = table_entry(NONDETERMINISTIC, run, name)
    if unknowable is not None:
        return pytest.param(run, name, marks=pytest.mark.skip(reason=f"result is uninitialised memory: {unknowable}"))
    expected = table_entry(EXPECTED_FAILURES, run, name)
    if expected is not None:
        raises, reason = expected
        return pytest.param(run, name, marks=pytest.mark.xfail(strict=True, raises=raises, reason=reason))
    return pytest.param(run, name)


@pytest.mark.parametrize("run,name", [_param(r, n) for r in RUNS for n in OPS if _has_variant(OPS[n], RUNS[r][0])])
def test_op_matches_cpu(run, name):
    try:
        run_and_record(run, name)
    except CpuSamplesDoNotRun as e:
        pytest.skip(f"CPU samples do not run: {e}")


def test_expected_failure_tables_name_real_ops_and_runs():
    prefixes = set(RUNS) | {variant for variant, _ in RUNS.values()}
    bad = []
    for key in list(EXPECTED_FAILURES) + list(CRASHES) + list(NONDETERMINISTIC):
        prefix, sep, name = key.rpartition(":")
        if name not in OPS or (sep and prefix not in prefixes):
            bad.append(key)
    assert not bad, f"entries for ops not in op_db or unknown runs (renamed upstream?): {bad}"


def pass_rate_line(passed: int, total: int, run: str) -> str:
    return f"OpInfo: {passed} of {total} ops whose CPU samples run pass on neuron ({run}, {passed / total:.1%})"


def _complete_results(run: str) -> None:
    """Run the ops this session did not (a -k selection) so the rate covers every op."""
    for name in OPS:
        if (run, name) in RESULTS or not _has_variant(OPS[name], RUNS[run][0]):
            continue
        if table_entry(CRASHES, run, name) is not None or table_entry(NONDETERMINISTIC, run, name) is not None:
            RESULTS[(run, name)] = "fail"
            continue
        try:
            run_and_record(run, name)
        except Exception:  # recorded as "fail" or "cpu" by run_and_record
            pass


@pytest.mark.parametrize("run", list(RUNS))
def test_opinfo_pass_rate(request, run):
    """Counts over every op, then prints "OpInfo: N of M ..." at the end and checks the rate."""
    _complete_results(run)
    results = [r for (rn, _), r in RESULTS.items() if rn == run and r != "cpu"]
    assert results, f"no op had CPU samples that run for {run}: the OpInfo database did not load"
    passed = results.count("pass")
    line = pass_rate_line(passed, len(results), run)
    _summary_lines(request.config).append(line)
    assert passed / len(results) >= MIN_PASS_RATE, line


class _Summary:
    """Prints the pass-rate lines at the end of the session, after pytest's own summary."""

    def __init__(self):
        self.lines: list[str] = []

    def pytest_terminal_summary(self, terminalreporter):
        for line in self.lines:
            terminalreporter.write_line(line)


def _summary_lines(config) -> list[str]:
    plugin = config.pluginmanager.get_plugin("opinfo-summary")
    if plugin is None:
        plugin = _Summary()
        config.pluginmanager.register(plugin, "opinfo-summary")
    return plugin.lines


# -- generic dispatch bugs this sweep found, pinned directly ----------------------------------
def test_conj_and_neg_views_keep_their_flag_through_ops_and_reads():
    """A conj view's flag must survive ops, copies and host reads."""
    x = torch.randn(4, dtype=torch.complex64)
    c = x.to(NEURON).conj()
    assert c.is_conj()
    torch.testing.assert_close((c * 2).cpu(), x.conj() * 2)  # mul dropped the conjugation before
    torch.testing.assert_close(c[1:].clone().cpu(), x.conj()[1:])
    torch.testing.assert_close(torch.dot(c, c).cpu(), torch.dot(x.conj(), x.conj()))
    assert c.tolist() == x.conj().tolist()
    host = torch.empty_like(x)
    host.copy_(c)
    torch.testing.assert_close(host, x.conj())
    torch.testing.assert_close(c._neg_view().cpu(), -x.conj())


def test_composite_kernels_building_conj_views_internally_match_cpu():
    """linalg_pinv runs as one host kernel that builds A.mH itself; it needs the Conjugate key."""
    a = torch.randn(5, 5, dtype=torch.complex64)
    torch.testing.assert_close(torch.linalg.pinv(a.to(NEURON)).cpu(), torch.linalg.pinv(a))


def test_sparse_results_raise_an_error_that_names_the_layout_and_the_fix():
    with pytest.raises(NotImplementedError, match=r"dense \(strided\) only.*sparse_coo.*Keep sparse tensors on the CPU"):
        torch.ones(3, 3, device=NEURON).to_sparse()
