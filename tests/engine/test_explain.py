"""adaptive_eager.explain(): the engine's report shows its traces, counters and flushes."""
import cachetools
import torch

import adaptive_eager
from adaptive_eager.explain import _cached_traces

# Sizes no other test uses, so that traces cached by earlier tests cannot match these ops.
_WIDTH, _BATCH, _CLASSES = 40, 12, 5


def _mlp_loop(steps: int, read_loss: bool):
    """Train a small MLP; returns the ops the last step issued (the steady-state step)."""
    model = torch.nn.Sequential(torch.nn.Linear(_WIDTH, _WIDTH), torch.nn.ReLU(),
                                torch.nn.Linear(_WIDTH, _CLASSES)).to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(_BATCH, _WIDTH).to("neuron")
    y = torch.randint(0, _CLASSES, (_BATCH,)).to("neuron")
    ops_last_step = 0
    for _ in range(steps):
        before = adaptive_eager.stats().ops
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if read_loss:
            loss.item()  # a host read: a sync point
        opt.zero_grad()
        loss.backward()
        opt.step()
        ops_last_step = adaptive_eager.stats().ops - before
    torch.neuron.synchronize()
    return ops_last_step


def test_explain_lists_the_trace_of_a_steady_training_step():
    with adaptive_eager.mode("adaptive"):
        ops_per_step = _mlp_loop(steps=8, read_loss=False)
        report = adaptive_eager.explain()
    text = str(report)
    steady = [t for t in report.traces if t.hits > 0 and t.length == ops_per_step]
    assert ops_per_step > 0 and steady, f"no trace of {ops_per_step} ops with hits:\n{text}"
    trace = steady[0]
    assert f"trace {trace.id:>4}: {trace.length:>5} ops  hits {trace.hits:>5}" in text
    assert f"{trace.first_op} ... {trace.last_op}" in text
    assert trace.first_op.startswith("aten.") and trace.last_op.startswith("aten.")
    assert report.mode == "adaptive" and "mode adaptive" in text
    assert report.stats.fused_launches > 0 and 0 < report.fused_share <= 1
    assert report.stats.launches < report.stats.ops  # fused: fewer launches than ops


def test_explain_counts_flushes_at_a_host_read_inside_a_learned_step():
    with adaptive_eager.mode("adaptive"):
        _mlp_loop(steps=6, read_loss=False)  # the engine learns the step without reads
        adaptive_eager.reset_stats()
        steps = 4
        _mlp_loop(steps, read_loss=True)  # now loss.item() cuts the learned step each time
        report = adaptive_eager.explain()
    host_reads = {r: n for r, n in report.flushes.items()
                  if "_local_scalar_dense" in r or r == "host read"}
    # Every step but the first (its first ops follow the fresh model's setup, not the trace).
    assert host_reads and sum(host_reads.values()) >= steps - 1, str(report)
    reason = next(iter(host_reads))
    assert f"{reason} {host_reads[reason]}" in str(report)
    assert any(reason in event for event in report.recent_flushes)


def test_explain_says_when_the_engine_is_off():
    with adaptive_eager.mode("eager"):
        x = torch.ones(3, device="neuron")
        (x + x).sum()
        report = adaptive_eager.explain()
    assert report.mode == "eager"
    assert "mode eager" in str(report) and "eager mode: every op is its own launch" in str(report)
    assert report.stats.fused_launches == 0 and report.stats.launches == report.stats.ops


def test_explain_reads_the_trace_cache_without_changing_its_eviction_order():
    cache = cachetools.LRUCache(maxsize=2)
    cache["old"], cache["new"] = "old trace", "new trace"
    assert _cached_traces(cache) == ["old trace", "new trace"]
    cache["newest"] = "newest trace"  # evicts the least recently used: still "old"
    assert "old" not in cache and "new" in cache
