"""Traces that stand in the way retire (issue 36, Note [A trace that keeps diverging retires] in
adaptive_eager/engine/executor.py): a short trace entered inside a longer unit must not keep
the unit from being found, and a trace the stream no longer follows stops being entered.

Counts, not times: launches per step from adaptive_eager.stats() deltas.
"""
import torch

import adaptive_eager

STEPS = 12


def _normed(x, w):
    """A matmul and an RMS norm: the unit Qwen3 runs for its queries and again for its keys,
    at other sizes (so the two are one shape-generic unit)."""
    h = x @ w
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


def _qwen3_like_step(x, wq, wk, w_gate, w_up, w_down):
    q, k = _normed(x, wq), _normed(x, wk)
    h = (torch.nn.functional.silu(x @ w_gate) * (x @ w_up)) @ w_down  # matmuls the q/k unit starts alike
    return (q.sum(-1) + k.sum(-1) + h.sum(-1)).tanh()


def _run(mode, steps=STEPS):
    g = torch.Generator().manual_seed(0)
    shapes = ((6, 8), (8, 8), (8, 4), (8, 16), (8, 16), (16, 8))
    args = [torch.randn(*s, generator=g).to("neuron") for s in shapes]
    outs, launches = [], []
    with adaptive_eager.mode(mode):
        adaptive_eager.reset_stats()
        for _ in range(steps):
            before = adaptive_eager.stats(wait=False).launches
            outs.append(_qwen3_like_step(*args))
            launches.append(adaptive_eager.stats(wait=False).launches - before)
        outs = [o.cpu() for o in outs]
    return outs, launches


def test_a_short_generic_trace_entered_inside_the_step_retires_and_the_step_runs_as_one_launch():
    """Qwen3's training step ran as 101 launches: its q/k norm, cached first as a 7-op
    shape-generic trace, was entered at every matmul of the step, so the other matmuls never
    ran eagerly and the whole step could not be described. The short trace retires; the step
    is found and runs as one launch."""
    eager, _ = _run("eager")
    adaptive, launches = _run("adaptive")
    assert all(torch.equal(a, b) for a, b in zip(eager, adaptive))
    assert launches[-4:] == [1, 1, 1, 1], launches
    report = adaptive_eager.explain()
    assert any(t.sizes and t.length < 20 for t in report.retired), report
    assert "recently retired traces" in str(report)


def _phase_a(x):
    return x.mul(2).add(1).relu().sum().tanh()


_TAILS = (torch.exp, torch.sin, torch.cos, torch.neg, torch.abs)


def _phase_b(x, k):
    # As phase A for two ops, then a tail of ops in an order that never repeats: no trace of
    # its own, ever.
    y = x.mul(2).add(1)
    for step in range(3):
        y = _TAILS[(k * 7 + step * k * k) % 5](y)
    return y


def test_a_trace_that_diverges_again_and_again_retires_and_is_not_entered_any_more():
    x = torch.randn(8, 8).to("neuron")
    with adaptive_eager.mode("adaptive"):
        for _ in range(STEPS):
            _phase_a(x)
        torch.neuron.synchronize()
        phase_a = {t.id for t in adaptive_eager.explain().traces}
        assert phase_a
        outs = [_phase_b(x, k) for k in range(3 * STEPS)]
        got = [o.cpu() for o in outs]
        report = adaptive_eager.explain()
    assert all(torch.equal(g, _phase_b(x.cpu(), k)) for g, k in zip(got, range(3 * STEPS)))
    retired = [t for t in report.retired if t.id in phase_a]
    assert retired and not phase_a & {t.id for t in report.traces}, report
    assert retired[0].divergences == 8  # then it is entered no more


def _layers_step(x, weights):
    """Layers of different widths, each the same ops: one shape-generic unit whose sizes
    recur every step (as the per-layer backward of a DDP step), then a tail."""
    outs = [torch.relu(x @ w).mul(3).add(1).sum(0) for w in weights]
    return torch.cat(outs).tanh().mul(2).add(1)


def test_a_step_whose_ops_a_generic_trace_matched_from_the_start_is_still_adopted_whole():
    """Note [An exact proto from a generic position]: the generic unit is adopted inside the
    first step, so its later layers never run eagerly; describing them from the generic
    position lets the step be adopted (it never was: one launch per layer, for ever)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 8, generator=g).to("neuron")
    weights = [torch.randn(8, n, generator=g).to("neuron") for n in (3, 5, 7, 9)]
    expected = _layers_step(x.cpu(), [w.cpu() for w in weights])
    with adaptive_eager.mode("adaptive"):
        launches = []
        for _ in range(STEPS):
            before = adaptive_eager.stats(wait=False).launches
            out = _layers_step(x, weights)
            launches.append(adaptive_eager.stats(wait=False).launches - before)
        got = out.cpu()
    assert torch.equal(got, expected)
    assert launches[-4:] == [1, 1, 1, 1], launches
