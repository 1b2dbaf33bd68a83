"""The adaptive engine: record the op stream, find what repeats, replay it as one launch.

It is the `Executor` (adaptive_eager.dispatch.executor) that adaptive mode installs; the
C++ route (device/csrc/engine/route.cpp) hands it each op of a neuron tensor, and it answers
run now or defer (the C++ queue, device/csrc/engine/queue.cpp, holds what it defers).

- `executor.py`: AdaptiveExecutor, the per-op decision and the trace cache (its phases);
- `record.py`: OpRecord, one op as the engine sees it (its signature and keys), and a recorder;
- `detector.py`: the incremental period detector (what repeats, without markers);
- `segments.py`: segments between sync points that recur, though not in a row (a server's prefill);
- `trace.py`: OpProto and Trace, what is cached; `pending.py`: a trace being matched;
- `matchers.py`: the generated per-position matchers of exact traces;
- `generic.py`: shape-generic traces (sizes that change every step, Note [Shape-generic traces]);
- `config.py`: the engine's settings (read from adaptive_eager.device.settings).

A new detection rule goes into detector.py (what is a period) or executor.py (which period
becomes a trace, where it is cut); its unit test into tests/unit/.
"""
