"""The modelled schedule of a kernel's instructions on the NeuronCore's engines.

Note [Engine timeline]: every executed instruction is placed on its engine (Tensor, Vector,
Scalar, GpSimd, or one of the 16 DMA queues of its NeuronCore). An engine runs its
instructions in program order, one at a time; an instruction starts when its engine is free
and when the instructions it depends on have finished: the last writer of anything it reads
(read after write), and the last reader or writer of anything it writes (write after read,
write after write), found by overlap of the memory each one touched (partition x free-offset
boxes on chip, element ranges in HBM). Engines otherwise overlap, as the hardware's do
once the compiler has placed its semaphores. The kernel's modelled time is the end of its
last instruction: the critical path through these dependences and engine queues.
"""
from __future__ import annotations

import json
from collections import defaultdict

from . import costs


class Instr:
    __slots__ = ("name", "engine", "ns", "latency_ns", "engines", "reads", "writes", "start", "end", "core", "queue")

    def __init__(self, name: str, engine: str, cost, reads, writes):
        self.name, self.engine = name, engine
        self.ns, self.latency_ns, self.engines = float(cost.ns), float(cost.latency_ns), cost.engines
        self.reads, self.writes = reads, writes
        self.start = self.end = 0.0
        self.core = self.queue = 0

    @property
    def visible(self) -> float:
        """When what it wrote can be read (and what it read may be overwritten)."""
        return self.end + self.latency_ns


def _box(t):
    """(lo, hi) boxes of the memory a view touches: partitions and free offsets on chip."""
    span = sum((n - 1) * s for n, s in zip(t.shape, t.strides))
    scale = t.dtype.itemsize / t.storage.dtype.itemsize  # in storage elements
    if t.on_chip:
        pstride = t.storage.partition_stride
        first = t.offset * scale
        p0 = int(first // pstride)
        f_lo = first - p0 * pstride
        f_span = sum((n - 1) * s for n, s in zip(t.shape[1:], t.strides[1:])) * scale
        p_span = (t.shape[0] - 1) * t.strides[0] * scale // pstride if t.shape else 0
        return (p0, f_lo), (p0 + p_span, f_lo + f_span + scale - 1)
    lo = t.offset * scale
    return (0, lo), (0, lo + span * scale + scale - 1)


def _overlap(a_lo, a_hi, b_lo, b_hi) -> bool:
    return a_lo[0] <= b_hi[0] and b_lo[0] <= a_hi[0] and a_lo[1] <= b_hi[1] and b_lo[1] <= a_hi[1]


class Timeline:
    def __init__(self, target, lnc: int = 1):
        self.target = target
        self.lnc = lnc
        self.instrs: list[Instr] = []
        self._engine_free: dict = defaultdict(float)
        # per storage: {(lo, hi): [last write end, last read end]}
        self._access: dict = defaultdict(dict)
        # bytes of each copy the framework makes of a kernel's non-row-major arguments (Note
        # [Kernel arguments are row-major arrays] in kernel.py), set when the kernel has run
        self.staged: list[int] = []

    def issue(self, program, instr: Instr) -> None:
        plan = self._prepare(program, instr)
        self._commit(instr, max(plan[0], plan[1]), plan)

    def issue_joint(self, entries) -> None:
        """A collective: one instruction per (program, instr), all starting together, when the
        last of them could (Note [Engine timeline])."""
        plans = [(instr, self._prepare(program, instr)) for program, instr in entries]
        start = max(max(ready, free) for _, (ready, free, *_rest) in plans)
        for instr, plan in plans:
            self._commit(instr, start, plan)

    def _prepare(self, program, instr: Instr):
        """(ready, engines free, engine keys, touched boxes) of an instruction about to be placed."""
        core = program.core
        ready = 0.0
        touched = []
        for t, writing in [(r, False) for r in instr.reads] + [(w, True) for w in instr.writes]:
            if t.storage is None:
                continue
            lo, hi = _box(t)
            entries = self._access[t.storage.serial]
            for (elo, ehi), (w_end, r_end) in entries.items():
                if _overlap(lo, hi, elo, ehi):
                    ready = max(ready, w_end, r_end if writing else 0.0)
            touched.append((t, lo, hi, writing))
        if instr.engine == costs.DMA:  # the DMA engines that free first, as many as it spreads over
            pool = sorted(range(costs.DMA_ENGINES), key=lambda q: self._engine_free[(core, costs.DMA, q)])
            keys = [(core, costs.DMA, q) for q in pool[:instr.engines]]
            instr.queue = pool[0]
        else:
            keys = [(core, instr.engine)]
        instr.core = core
        return ready, max(self._engine_free[k] for k in keys), keys, touched

    def _commit(self, instr: Instr, start: float, plan) -> None:
        _, _, keys, touched = plan
        instr.start, instr.end = start, start + instr.ns
        for k in keys:
            self._engine_free[k] = instr.end
        instr.reads = instr.writes = ()  # the timeline keeps no tile alive (Note [On-chip capacity])
        for t, lo, hi, writing in touched:
            entries = self._access[t.storage.serial]
            if writing:  # accesses this write covers are ordered before it: drop them
                for k in [k for k in entries if lo[0] <= k[0][0] and k[1][0] <= hi[0]
                          and lo[1] <= k[0][1] and k[1][1] <= hi[1]]:
                    del entries[k]
                entries[(lo, hi)] = [instr.visible, instr.end]
            else:
                w_end, r_end = entries.get((lo, hi), (0.0, 0.0))
                entries[(lo, hi)] = [w_end, max(r_end, instr.end)]
        self.instrs.append(instr)

    # --- results ----------------------------------------------------------------------------------------
    @property
    def total_ns(self) -> float:
        """The kernel's modelled time: until the last result is visible."""
        return max((i.visible for i in self.instrs), default=0.0)

    def busy_ns(self) -> dict[str, float]:
        """Busy time per engine (summed over cores; DMA over its 16 engines)."""
        busy = {e: 0.0 for e in costs.ENGINES}
        for i in self.instrs:
            busy[i.engine] += i.ns * i.engines
        return busy

    def report(self) -> "KernelProfile":
        return KernelProfile(self)


class KernelProfile:
    """What `profile(kernel, *args)` returns: modelled time, per-engine busy time and use."""

    def __init__(self, timeline: Timeline):
        self.timeline = timeline
        self.total_us = timeline.total_ns / 1000
        self.instructions = len(timeline.instrs)
        busy = timeline.busy_ns()
        self.busy_us = {e: ns / 1000 for e, ns in busy.items()}
        span = timeline.total_ns or 1.0
        cores = timeline.lnc
        self.utilization = {e: (busy[e] / span / cores / (costs.DMA_ENGINES if e == costs.DMA else 1))
                            for e in costs.ENGINES}
        self.counts = defaultdict(int)
        for i in timeline.instrs:
            self.counts[i.name] += 1

    def __repr__(self) -> str:
        lines = [f"NKI kernel on {self.timeline.target.name}: {self.total_us:.2f} us modelled, "
                 f"{self.instructions} instructions"]
        for e in costs.ENGINES:
            of = " (16 DMA engines)" if e == costs.DMA else ""
            lines.append(f"  {e:<7} busy {self.busy_us[e]:9.2f} us  ({100 * self.utilization[e]:5.1f}% of the kernel{of})")
        return "\n".join(lines)

    def chrome_trace(self) -> dict:
        """A Chrome/Perfetto trace: one track per engine (and per DMA queue), times in us."""
        events, tids = [], {}
        for i in self.timeline.instrs:
            track = f"core{i.core}.{i.engine}" + (f".{i.queue}" if i.engine == costs.DMA else "")
            tid = tids.setdefault(track, len(tids))
            events.append({"name": i.name, "ph": "X", "pid": 0, "tid": tid, "ts": i.start / 1000,
                           "dur": max(i.ns / 1000, 1e-3),
                           "args": {"engine": i.engine, "latency_us": i.latency_ns / 1000, "dma_engines": i.engines}})
        for track, tid in tids.items():
            events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": track}})
        return {"traceEvents": events, "displayTimeUnit": "ns"}

    def export_chrome_trace(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)


def issue_across(entries) -> None:
    """A collective between ranks, each with its own timeline: one instruction per (timeline,
    program, instr), all starting together when the last of them could, each rank's timeline
    keeping its own engines and memories (Note [Engine timeline])."""
    plans = [(timeline, instr, timeline._prepare(program, instr)) for timeline, program, instr in entries]
    start = max(max(plan[0], plan[1]) for _, _, plan in plans)
    for timeline, instr, plan in plans:
        timeline._commit(instr, start, plan)
