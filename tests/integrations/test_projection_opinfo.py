"""Projection mode against PyTorch's OpInfo database: an op projected costs what it costs with bytes.

For every OpInfo (float32, the function variant), the first sample that runs on neuron with
bytes runs again in projection mode (adaptive_eager.projection), its tensors moved to the device
there (so without bytes): the results' geometry (shape, strides, offset, storage size, dtype)
and what the device spent (launches, modelled µs, memory held, transfers) must be the same.
Projection runs each op's Meta kernel where the run with bytes runs its CPU kernel, so this is
where a Meta kernel that sizes or lays out a result otherwise than CPU's shows (Note [Losses on
their buffer] in device/csrc/aten/run_on_host.cpp came from here); an op without one runs its CPU
kernel on zeros (Note [Value-dependent ops on placeholder values]). Known differences are
strict xfails with their cause, so a fix shows up as an XPASS; ops whose sizes are data are
not strict (zeros give the sample's sizes or not).
"""
from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch.utils._pytree import tree_flatten

import adaptive_eager

pytest.importorskip("expecttest")  # common_methods_invocations imports it
from test_opinfo import OPS, RANDOM_OPS, to_neuron  # noqa: E402

EXPECTED_DIFFERENCES = {
    # No Meta kernel, and a CPU kernel that writes into its arguments (so it cannot run on zeros
    # instead: Note [Value-dependent ops on placeholder values]): refused by name.
    "cummax": "no Meta kernel; CPU's _cummax_helper writes into its arguments: refused by name",
    "cummin": "no Meta kernel; CPU's _cummin_helper writes into its arguments: refused by name",
    "linalg.lstsq": "no Meta kernel, and no CPU kernel of its own to run on zeros: refused by name",
    "linalg.lstsq.grad_oriented": "no Meta kernel, and no CPU kernel of its own to run on zeros: refused by name",
    # A host read answers a placeholder (0), and the op's Python body takes another path on it.
    "corrcoef": "reads a value on the host: the placeholder takes another path (one launch more)",
    "cov": "reads a value on the host: the placeholder takes another path (one launch more)",
    # LAPACK's outputs come column-major from CPU's kernels; their Meta kernels say row-major.
    "svd_lowrank": "Meta's strides for a LAPACK result differ from CPU's",
    "pca_lowrank": "Meta's strides for a LAPACK result differ from CPU's",
    "linalg.eig": "Meta's strides for a LAPACK result differ from CPU's",
    "nonzero_static": "an empty result's strides: (1, 0) on meta, (1, 1) on CPU",
    "nn.functional.embedding_bag": "its traffic is priced from the offsets' values (Note [Gathers and scatters])",
}
# Outputs whose sizes are data: projected, they run on zeros (Note [Value-dependent ops on
# placeholder values]), which give this sample's sizes or not: not strict.
VALUE_DEPENDENT = {"argwhere", "combinations", "masked_select", "nonzero", "unique", "unique_consecutive"}


def _geometry(out):
    leaves, _ = tree_flatten(out)
    return [(tuple(t.shape), t.stride(), t.storage_offset(), t.untyped_storage().nbytes(), t.dtype)
            if isinstance(t, torch.Tensor) else type(t).__name__ for t in leaves]


def _run(op, sample, projected: bool):
    """The results' geometry and what the device spent on the op (not on moving its inputs)."""
    torch.neuron.synchronize()
    with adaptive_eager.projection() if projected else contextlib.nullcontext():
        inputs = to_neuron((sample.input, sample.args, sample.kwargs))
        before = adaptive_eager.stats()
        out = op(inputs[0], *inputs[1], **inputs[2])
        after = adaptive_eager.stats()
        return _geometry(out), dict(launches=after.launches - before.launches,
                                    device_time_us=after.device_time_us - before.device_time_us,
                                    memory=after.memory_bytes - before.memory_bytes,
                                    transfers=after.transfers - before.transfers)


def _params():
    for name in sorted(OPS):
        if name in RANDOM_OPS or OPS[name].name in RANDOM_OPS:
            continue
        marks = []
        if name in EXPECTED_DIFFERENCES:
            marks = [pytest.mark.xfail(strict=True, reason=EXPECTED_DIFFERENCES[name])]
        elif name in VALUE_DEPENDENT:
            marks = [pytest.mark.xfail(strict=False, reason="sizes are data: run on zeros, the sample's sizes or not")]
        yield pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", _params())
def test_a_projected_op_spends_and_shapes_as_with_bytes(name):
    op = OPS[name]
    warnings.simplefilter("ignore")
    with adaptive_eager.mode("eager"):
        try:
            samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=False))
        except Exception as err:  # noqa: BLE001  (the op's own sample generator)
            pytest.skip(f"its samples do not build on CPU: {type(err).__name__}")
        for sample in samples[:3]:
            try:
                with_bytes = _run(op, sample, projected=False)
            except Exception:  # noqa: BLE001  (test_opinfo.py says whether neuron runs it)
                continue
            geometry, spent = _run(op, sample, projected=True)
            assert geometry == with_bytes[0]
            # The same op priced the same; only the clock's running total it is read from differs.
            assert spent == pytest.approx(with_bytes[1], rel=1e-12, abs=1e-9)
            return
    pytest.skip("no sample runs on neuron with bytes (test_opinfo.py covers why)")
