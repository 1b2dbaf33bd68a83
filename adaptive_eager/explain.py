"""`adaptive_eager.explain()`: what the adaptive engine has done and why, in words.

Read-only: it looks at the engine (its trace cache, counters and recent events) and never
changes it, not even the cache's least-recently-used order.
"""
from __future__ import annotations

import dataclasses

import cachetools

from adaptive_eager.device import stream as device_stream

from .mode import SWITCH
from .stats import Stats, stats

_MAX_TRACES_SHOWN = 20  # the report stays readable; `Explanation.traces` has them all


@dataclasses.dataclass(frozen=True)
class TraceSummary:
    """One cached trace, as explain() shows it."""

    id: int
    length: int  # ops in the trace
    hits: int  # matches that ran to the end
    divergences: int  # matches abandoned at an op that differed
    first_op: str
    last_op: str
    starts_at: str | None = None  # the user's source line of the first op (once matched)
    # Sizes that change from match to match (Note [Shape-generic traces]); 0: an exact trace.
    sizes: int = 0

    def __str__(self) -> str:
        where = f"  starts at {self.starts_at}" if self.starts_at else ""
        generic = f"  shape-generic ({self.sizes} changing sizes)" if self.sizes else ""
        return (f"trace {self.id:>4}: {self.length:>5} ops  hits {self.hits:>5}  "
                f"divergences {self.divergences:>4}  {self.first_op} ... {self.last_op}{generic}{where}")


@dataclasses.dataclass(frozen=True)
class Explanation:
    """A snapshot of the engine; `str()` (or printing it) gives the readable report."""

    mode: str
    stats: Stats
    traces: tuple[TraceSummary, ...]
    flushes: dict  # reason -> pending work launched early
    recent_divergences: tuple[str, ...]  # oldest first
    recent_flushes: tuple[str, ...]  # oldest first
    phase: str = ""  # the engine's phase (Note [Engine phases]), and whether detection is paused
    # traces evicted for blocking a longer unit or diverging again and again (Note [A trace that
    # keeps diverging retires]), oldest first
    retired: tuple[TraceSummary, ...] = ()

    @property
    def fused_share(self) -> float:
        """Fraction of the ops run on the device that ran inside fused launches."""
        return self.stats.fused_ops / self.stats.kernel_ops if self.stats.kernel_ops else 0.0

    def __str__(self) -> str:
        return "\n".join(_render(self))

    __repr__ = __str__  # so that `adaptive_eager.explain()` at a prompt prints the report


def explain() -> Explanation:
    """Report the engine's mode, counters, cached traces, and recent divergences and flushes."""
    engine = SWITCH.adaptive
    with engine._lock:  # a consistent snapshot while other threads (autograd's) run ops
        traces = tuple(sorted((_summary(t) for t in _cached_traces(engine.cache)), key=lambda t: t.id))
        return Explanation(
            mode=SWITCH.get(),
            stats=stats(),
            traces=traces,
            flushes=dict(engine.counters.flushes),
            recent_divergences=tuple(engine.recent_divergences),
            recent_flushes=tuple(engine.recent_flushes),
            phase=engine.phase.value + (", detection paused" if engine.detection_paused else "")
            + (" (it found nothing new for a while: Note [Detection that finds nothing pauses])"
               if engine._quiet_until is not None else ""),
            retired=tuple(_summary(t) for t in engine.recent_retired),
        )


def _cached_traces(cache) -> list:
    # LRUCache.values() goes through LRUCache.__getitem__, which marks every entry as just
    # used and so rewrites the eviction order; the base Cache lookup reads without touching.
    return [cachetools.Cache.__getitem__(cache, key) for key in list(cache)]


def _summary(trace) -> TraceSummary:
    return TraceSummary(id=trace.id, length=len(trace), hits=trace.hits, divergences=trace.divergences,
                        first_op=trace.protos[0].name, last_op=trace.protos[-1].name,
                        starts_at=trace.sources[0], sizes=trace.nsyms)


def _render(e: Explanation) -> list[str]:
    s = e.stats
    lines = [f"adaptive-eager: mode {e.mode}" + (f" (engine {e.phase})" if e.phase else "")]
    if e.mode == "eager":
        lines.append("  eager mode: every op is its own launch; the engine is idle "
                     "(adaptive_eager.set_mode('adaptive') turns it on).")
    lines += [
        f"counters: {s.ops} ops, {s.launches} launches, {s.fused_launches} fused launches "
        f"running {s.fused_ops} ops (fused share {e.fused_share:.0%})",
        f"  trace hits {s.trace_hits}, divergences {s.divergences}, switches to a trace with the same start {s.trace_switches}",
        f"  {s.stream_launches} fused launches ran on the device stream, beside the host "
        f"({device_stream.stream_status()})",
        f"cached traces: {len(e.traces)}",
    ]
    shown = sorted(e.traces, key=lambda t: (-t.hits, t.id))[:_MAX_TRACES_SHOWN]
    lines += [f"  {t}" for t in sorted(shown, key=lambda t: t.id)]
    if len(e.traces) > len(shown):
        lines.append(f"  ... and {len(e.traces) - len(shown)} more with fewer hits")
    lines.append("flushes by reason: " + (", ".join(f"{r} {n}" for r, n in sorted(e.flushes.items()))
                                           if e.flushes else "none"))
    lines += _recent("recent divergences", e.recent_divergences)
    lines += _recent("recent flushes", e.recent_flushes)
    lines += _recent("recently retired traces (they blocked a longer unit, or kept diverging)",
                     tuple(str(t) for t in e.retired))
    return lines


def _recent(title: str, events: tuple[str, ...]) -> list[str]:
    if not events:
        return [f"{title}: none"]
    return [f"{title} (newest last):"] + [f"  {event}" for event in events]
