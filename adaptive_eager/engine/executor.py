"""The adaptive engine: record the op stream, find what repeats, replay it as one launch.

One engine, one phase at a time (Note [Engine phases] in phase.py), guarded by a lock:
- RECORDING: no trace is being matched. Each op runs eagerly, goes into the history and
  the period detector; if a cached trace starts with it, matching begins instead.
- MATCHING: `self.pending` holds a trace and how far the stream has followed it. An op
  that matches the next position is deferred; when the trace completes, it launches as one.
  A shape-generic trace (Note [Shape-generic traces] in generic.py) matches by how sizes
  relate, not by their values; a second detector, on size-erased keys, finds its unit.
- BACKING_OFF: the stream is mostly new signatures; ops run eagerly, unrecorded, a while.

Ops reach the engine through the C++ route (csrc/engine/route.cpp) while adaptive mode is on: the
C++ eager path hands each op of a neuron tensor to `route`. Deferral is what it is on an
asynchronous accelerator (Note [Deferred launches] in device/csrc/engine/queue.cpp): an op that
matches the next position of the trace is queued in C++ with the trace's output geometry (a
DeferPlan) and its results are handed out at once, as neuron tensors whose bytes the launch
will make. When the trace completes, or at a sync point, the queue runs as one launch.

- dataflow is not part of matching: a queued op holds its arguments themselves (their
  bytes, or the deferred outputs they are), so the launch reads what earlier ops wrote;
  the signature (shapes, strides, dtypes, structural arguments) fixes every output's
  geometry, which is all that is handed out early. Recorded ops still note which earlier
  op wrote each input's bytes, for the trace's cut (_quietest_cut);
- host reads need no Python hooks: the C++ host accesses (copies to or from the host,
  `item()`, resize_) call `_host_sync` while the engine is attached, a sync point each;
- a complete trace of C++ kernels runs on the device stream, beside the host (Note [The
  device stream] in csrc/engine/queue.cpp); each op is priced as in eager mode, one launch
  overhead for them all.

Note [Sync points]: an op that must run now (a host read, a transfer, a data-dependent
shape, a Python value result, a resize) launches whatever is pending first, then runs
eagerly; matching continues after it with the rest of the trace. A mismatching op
(divergence) launches the pending prefix, ends the match, and is handled afresh.
"""
from __future__ import annotations

import _thread
import collections
import itertools
import warnings

import cachetools
import torch

from adaptive_eager.device import native, stream
from adaptive_eager.device.profiling import (fused_range_name, mark_device_time, profile_range, profiler_enabled, sources_wanted,
                              sync_range)
from adaptive_eager.dispatch import Executor, classify
from adaptive_eager.dispatch.executor import RouteAnswer
from adaptive_eager.engine.record import OpRecord, signature_difference, user_source_line

from .matchers import INTERPRETED_MATCHES, compile_matcher
from .native_guards import compile_guards
from .config import EngineConfig
from .detector import PeriodDetector
from .generic import (GenericSighting, build_generic_trace, compile_generic_matcher, erase_key, fits_generic,
                      differs_in_sizes_only, erased_signature, exact_proto, generic_covers,
                      generic_difference)
from .pending import Pending, launch_error
from .phase import Phase
from .segments import RecurringSegments
from .trace import Trace, build_proto, build_trace, output_slots

_RECENT = 20  # divergences and flushes kept for explain()
_MIN_PAUSE_AFTER = 1024  # the least any later pause waits for (see _steady)
_FIRST_PAUSE_AFTER = 256  # ops matched in a row before detection first pauses (see _steady)
_QUIET_FACTOR, _MAX_QUIET_FACTOR = 4, 1024  # Note [Detection that finds nothing pauses]
_KEYS_KEPT = 100_000  # signatures the detectors' key tables hold before they start afresh
_QUIET_BEFORE_FEEDING = 4  # Note [Armed matching while detecting]: trace lengths with nothing found
_NONE_FIRED = (None, None)  # the detectors' answers to a push that found no period
_NOVELTY_WINDOW = 256  # recorded ops per novelty check (see _count_novelty)
_NOVELTY_SAMPLE = 128  # recorded ops per check once backing off
_MAX_BACKOFF = 4096  # longest stretch run without recording: a later repeating phase waits at most this long
_SHAPES_REPEATING = 16  # ops repeated by size-erased keys before new sizes stop counting as novelty
_RETIRE_STRIKES = 8  # divergences in a row, no completion between, that retire a trace (Note [A trace that keeps diverging retires])
_BLOCKER_DIVERGENCES = 4  # divergences before a trace that blocks a longer unit may retire
_RETIRED_KEPT = 4096  # keys of retired traces remembered, so that detection does not adopt them again
_EVER_CACHED_KEPT = 4096  # keys of traces detection cached, remembered to tell news from a comeback


class EngineCounters:
    def __init__(self):
        self.fused_launches = 0
        self.fused_ops = 0
        self.trace_hits = 0
        self.divergences = 0
        self.switches = 0  # matches handed to another trace with the same prefix (_switch_trace)
        self.generic_traces = 0  # shape-generic traces adopted (Note [Shape-generic traces])
        self.stream_launches = 0  # fused launches run on the device stream
        self.quiet_pauses = 0  # Note [Detection that finds nothing pauses]
        self.flushes: collections.Counter = collections.Counter()


class _TraceCache(cachetools.LRUCache):
    """Traces by key, least recently used evicted; keeps the index of first signatures."""

    def __init__(self, maxsize: int):
        super().__init__(maxsize)
        self.by_start: dict[tuple, list[Trace]] = {}
        # The same traces by their first op's OpOverload: the fast start (Engine._fast_start)
        # tries their generated first-position matchers without describing the call.
        self.by_first_op: dict = {}

    def add(self, trace: Trace) -> None:
        self[trace.key] = trace
        for index, key in ((self.by_start, trace.protos[0].signature), (self.by_first_op, trace.protos[0].info.op)):
            starts = index.setdefault(key, [])
            starts.append(trace)
            starts.sort(key=len, reverse=True)  # the longest match wins

    def demote(self, trace: Trace) -> None:
        """Note [A diverging trace yields its start]: try trace after the others that start alike."""
        for index, k in ((self.by_start, trace.protos[0].signature), (self.by_first_op, trace.protos[0].info.op)):
            starts = index.get(k, [])
            if len(starts) > 1 and trace in starts:
                starts.remove(trace)
                starts.append(trace)

    def popitem(self):
        key, trace = super().popitem()
        self._unindex(trace)
        return key, trace

    def remove(self, trace: Trace) -> None:
        """Evict trace's key. The cache may hold another Trace under it (adopted again after
        trace was evicted, while a match still held trace): both leave the index, else the
        one held would still be entered with no entry in the cache."""
        held = self.pop(trace.key, None)
        self._unindex(trace)
        if held is not None and held is not trace:
            self._unindex(held)

    def _unindex(self, trace: Trace) -> None:
        for index, k in ((self.by_start, trace.protos[0].signature), (self.by_first_op, trace.protos[0].info.op)):
            starts = index.get(k, [])
            if trace in starts:
                starts.remove(trace)


class _Barrier:
    """A sync op in the history (it ran eagerly, unseen): what the detector and _adopt read."""

    __slots__ = ("signature", "name", "erased", "ids")
    barrier = True
    device = None
    out_specs = ()

    def __init__(self, signature, name):
        self.signature = signature
        self.name = name
        self.erased = (erase_key(signature), None)  # what the shape detector sees
        self.ids = None  # the detectors' keys (AdaptiveExecutor._key_ids)


_HOST_ACCESS = _Barrier(("host access",), "host access")
_SYNC_MARK = _Barrier(("torch.neuron.synchronize",), "synchronize")


class _CatchingUpLock(_thread.RLock):
    """The engine's lock (re-entrant). Entering it takes, first, what the route matched in C++
    while armed (Note [Armed matching]): whatever the engine does next sees the match where
    it really is.

    Note [Interrupted issue]: a KeyboardInterrupt is raised at the next signal check, and the
    interpreter checks after every call and on entering every Python function. So its exit is
    the C lock's own (a Python __exit__ could be interrupted on entry, before its release), and
    its entry releases what it acquired whichever statement the interrupt lands on. Either
    slip left the lock held by the interrupted thread, and autograd's device thread, routing
    the next op, waited for it forever (a Ctrl-C-during-training test hung about 1 run in 12).
    """

    engine = None  # set once made: the C type's constructor takes no arguments in every Python

    def __enter__(self):
        held_before = self._is_owned()  # then acquire() cannot block, and always counts once
        try:
            self.acquire()
            self.engine._catch_up()
        except BaseException:
            if held_before or self._is_owned():
                self.release()
            raise
        return self


def _guard_table(trace: Trace):
    """The trace's positions for armed matching, or False if one of them cannot be matched
    in C++ (an opaque argument). A shape-generic trace's too (Note [Generic guards] in
    device/csrc/engine/guards.cpp); a plan its shape function makes at issue, C++ makes."""
    guards = []
    for proto in trace.protos:
        if proto.plan is None:
            return False
        g = compile_guards(proto)
        if not g.supported:
            return False
        guards.append(g)
    return native.GuardTable(guards, [proto.plan for proto in trace.protos])


class AdaptiveExecutor(Executor):
    """The engine: `route` is what the C++ route calls per op while adaptive mode is on."""

    name = "adaptive"

    def __init__(self, config: EngineConfig | None = None):
        self.config = config or EngineConfig.from_env()
        self._armed: Pending | None = None  # the match the route continues in C++
        self._armed_feeds = False  # Note [Armed matching while detecting]: its ops go to detection
        self._armed_pushes = False  # ... and the route pushed their keys (Note [Detection fed by the route])
        self._arm_generation = 0  # which arming _armed is (an interrupt may stop one before C++ got it)
        self._lock = _CatchingUpLock()
        self._lock.engine = self
        self.reset()

    def reset(self) -> None:
        """Forget every trace and all history (what is pending is launched first)."""
        self._catch_up()
        if getattr(self, "pending", None) is not None:
            self._flush("reset")
        if getattr(self, "inflight", None):
            self.drain()
        cfg = self.config
        self.cache = _TraceCache(cfg.cache_size)
        self.detector = PeriodDetector(cfg.min_trace_len_between_syncs, cfg.max_period, cfg.repeats,
                                       unit_min=cfg.min_trace_len)
        # Note [Shape-generic traces] (generic.py): the same, on size-erased keys.
        self.shape_detector = PeriodDetector(cfg.min_trace_len_between_syncs, cfg.max_period, cfg.repeats,
                                             unit_min=cfg.min_trace_len)
        # Note [Segments that recur apart] (segments.py): stretches between sync points seen before.
        self.segments = RecurringSegments(cfg.repeats, cfg.min_trace_len_between_syncs, cfg.max_trace_len)
        # Two periods of the longest unit: what _adopt reads when a period fires.
        self.history: collections.deque = collections.deque(maxlen=2 * cfg.max_period)
        self.key_ids: dict[tuple, int] = {}
        self.erased_ids: dict[tuple, int] = {}
        self._ids_token = object()  # names the two tables above: ids kept on protos (_key_ids)
        # (period, entries still to come): a shape period fired, and its two sightings are
        # taken once they start at the stream's own cut (_plan_generic).
        self._generic_wait: tuple[int, int] | None = None
        self.protos: dict[tuple, object] = {}
        # Note [A trace that keeps diverging retires]: the keys of retired traces, oldest first
        self.retired: collections.OrderedDict = collections.OrderedDict()
        self._ever_cached: collections.OrderedDict = collections.OrderedDict()  # _cache_found's keys
        self.barriers: dict[tuple, _Barrier] = {}  # sync ops by signature, as the history holds them
        self.phase = Phase.RECORDING  # Note [Engine phases]: changed by the transitions below only
        self.pending: Pending | None = None  # the match, while MATCHING
        # The launches on the device stream, oldest first (Note [The device stream]).
        self.inflight: collections.deque[Pending] = collections.deque()
        self.position = 0  # stream position of the next op
        self.counters = EngineCounters()
        self.recent_divergences: collections.deque = collections.deque(maxlen=_RECENT)
        self.recent_flushes: collections.deque = collections.deque(maxlen=_RECENT)
        self.recent_retired: collections.deque[Trace] = collections.deque(maxlen=_RECENT)  # for explain()
        self.error: Exception | None = None
        self._warned = False
        # (trace, stream position): a just-adopted trace takes over when the stream gets there
        self._enter_at: tuple[Trace, int] | None = None
        self._enter_period = 0  # the period whose adoption set _enter_at
        # Note [When detection pauses]: after this many ops in a row ran inside completed
        # traces, detection pauses: the steady-state cost per op is then matching alone. A
        # unit longer than every cached trace may not have repeated twice by then: a 64-layer
        # model's per-layer backward traces alone filled the first 1,024 ops, its head then
        # diverged, and its 1,882-op step ran as 154 launches for ever. So each time a pause
        # ends at a divergence, the next one waits twice as long (_resume_detection), up to
        # the ops that two repetitions of the longest unit take. The first pause comes
        # sooner, after _FIRST_PAUSE_AFTER ops (or 4 lengths of a trace adopted, _adopt):
        # until it, every op is recorded in the history (the route matches in C++ before it
        # too: Note [Armed matching while detecting]). A unit it pauses too soon for diverges,
        # and the doubling finds it one resumption later.
        self._steady = 0
        self._pause_after = _FIRST_PAUSE_AFTER
        self._max_pause_after = max(_MIN_PAUSE_AFTER, cfg.repeats * cfg.max_period)
        # The longest stretch without a sync point since detection last resumed: no trace is
        # longer, so a pause need not wait for more than a few of them (_resume_detection).
        self._last_sync_at = 0
        self._longest_unsynced = 0
        # Note [Detection that finds nothing pauses]
        self._fruitless = 0  # ops the detectors saw since they last found something new
        self._fruitless_limit = _MIN_PAUSE_AFTER
        self._quiet_factor = _QUIET_FACTOR  # a quiet pause lasts this many times the stretch before it
        self._quiet_until: int | None = None  # a quiet pause: its end, as a stream position
        self._fruitless_divergences: set = set()  # (trace id, position) of those since
        self._familiar_divergences: frozenset = frozenset()  # the set above, as a quiet pause began
        # Novelty backoff (see _count_novelty): ops left to run without recording (BACKING_OFF).
        self._backoff = 0
        self._backoff_len = _NOVELTY_WINDOW
        self._window_ops = self._window_novel = self._novel_windows = 0
        native.forget_producers()  # positions of the history just dropped

    def reset_counters(self) -> None:
        self.counters = EngineCounters()

    # -- phase transitions (Note [Engine phases]): the only writes of phase, pending, _backoff --
    def _match(self, p: Pending) -> None:
        """Match p's trace from here on: MATCHING."""
        self.phase, self.pending = Phase.MATCHING, p

    def _stop_matching(self) -> None:
        """No trace is matched (what was pending has launched, or runs at the next launch):
        back to RECORDING, or to BACKING_OFF if a backoff began meanwhile."""
        self._catch_up()
        self.pending = None
        self.phase = Phase.BACKING_OFF if self._backoff else Phase.RECORDING

    def _back_off(self, ops: int) -> None:
        """Run the next `ops` ops unrecorded; a match under way finishes first."""
        self._backoff = ops
        if self.pending is None:
            self.phase = Phase.BACKING_OFF

    def _backed_off(self) -> bool:
        """One op of the backoff ran; True if that was the last (RECORDING again)."""
        self._backoff -= 1
        if self._backoff:
            return False
        self.phase = Phase.RECORDING
        return True

    @property
    def detection_paused(self) -> bool:
        """Note [When detection pauses]: a long stretch ran inside cached traces, and the history
        and detectors are not fed until the stream leaves them."""
        return self._steady >= self._pause_after

    # -- the route's two ends ----------------------------------------------------------------
    def attach(self) -> None:
        native.set_host_sync(self._host_sync)
        native.set_engine(self.route, self.issue_failed)

    def detach(self) -> None:
        native.set_engine(None)
        with self._lock:  # takes what armed matching queued, and disarms
            pass

    # -- Note [Armed matching] (device/csrc/engine/route.cpp) --------------------------------
    def _catch_up(self) -> None:
        """Take the positions the route matched in C++ since the engine armed it, and disarm
        it. Absolute values, and cleared last: an interrupt midway leaves it to redo."""
        p = self._armed
        if p is None:
            return
        (generation, pos, position, rounds, collected, syms, recent_sizes, sizes_repeat, last_sync_at,
         longest_unsynced, fired) = native.disarm()
        if generation == self._arm_generation:  # else C++ never got this arming: nothing matched
            if rounds:
                self._take_rounds(p, pos, position, rounds, collected, syms)
                if p.trace.generic:  # the sizes each round met, as _complete notes them
                    p.trace.recent_sizes.clear()
                    p.trace.recent_sizes.extend(tuple(sizes) for sizes in recent_sizes)
                    p.trace.sizes_repeat = p.trace.sizes_repeat or sizes_repeat
            else:
                if self._armed_feeds:
                    self._feed_matched(p, pos, position, syms, fired)
                p.pos = pos
                p.syms = syms
                self.position = position
            # Note [Armed syncs]: the host accesses the route took between rounds, as _note_sync.
            self._last_sync_at = last_sync_at
            self._longest_unsynced = max(self._longest_unsynced, longest_unsynced)
        self._armed = None

    def _feed_matched(self, p: Pending, pos: int, end: int, syms: list, fired: tuple | None) -> None:
        """Note [Armed matching while detecting]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        Before detection first pauses, the route matched p's positions up to `pos` in C++
        (stream positions up to `end`) as it does once paused, but detection must see each of
        them: they go into the history here, in order, as _defer would have put them there one
        by one. Matching a small MLP's 28-op step in Python cost about 25 us an op (the route's
        call, describing the call, comparing, recording) against 6 for the history alone, and
        its steps ran so until detection first paused, about the 14th: adaptive mode's first 30
        steps cost 1.3-1.5x eager's (issue 35 asks 1.2x).
        Detection runs late by at most a trace, so an adoption it makes here may place the new
        trace's start (_enter_at) at a position the route has passed, where the engine, matching
        op by op, would have handed the match over to it: the stream is periodic, so it is
        entered a period later. That cost real models a step of whole-step fusion each time
        (Gemma3's training reached one launch a step two steps later, Qwen3's one): while
        detection keeps finding units, every few ops, the stream is matched op by op as before,
        and the route matches before the pause only once detection has found nothing new for
        _QUIET_BEFORE_FEEDING lengths of the trace (as the first pause waits 4 lengths of the
        unit it adopted). That lag is gone where the route pushes each op's keys to the detectors
        itself (Note [Detection fed by the route] in route.cpp: an exact trace whose keys are
        known) and stops after an op whose keys fired: the route is armed so from the trace's
        second match (its first takes the source lines), and here each op goes into the history
        with what its push answered, the adoption made at the op that fired. The small MLP's
        steps 4-12 then cost the user's and autograd's threads 0.53 and 0.22 million
        instructions over eager mode's each, where they cost 1.6 and 0.8 (steps 4-5, matched in
        Python) and 0.7 and 0 (7-12, fed by Python) before (bench/warmup_instructions.py).
        Each op is taken as it is fed (p.pos), so an interrupt midway leaves the rest for the
        next entry (Note [Interrupted issue]), and none is fed twice."""
        trace = p.trace
        pushes = self._armed_pushes
        for k in range(p.pos, pos):
            position = end - (pos - k)
            # Fed already if an interrupt landed after its _advance, before p.pos moved on: a
            # position twice in the history would misplace every cut _adopt takes after it.
            if not (self.history and self.history[-1][0] >= position):
                self.position = position
                proto = trace.protos[k]
                # What the route's push of this op's keys answered (it stops after one fires).
                pushed = (fired[1:] if fired is not None and fired[0] == k else _NONE_FIRED) if pushes else None
                p.positions.append(self._advance(GenericSighting(proto, syms) if trace.generic else proto, _MATCHED,
                                                 pushed))
            p.pos = k + 1
        if self._enter_at is not None and self._enter_at[1] < end:
            entering, at = self._enter_at
            self._enter_at = (entering, at + -(-(end - at) // self._enter_period) * self._enter_period)

    def _take_rounds(self, p: Pending, pos: int, position: int, rounds: int, collected: int, syms: list) -> None:
        """Note [Armed rounds]: the route completed p's trace `rounds` times, each submitted to
        the device stream as _launch does, collected `collected` outcomes (none failed), and
        is at position `pos` of the next round, with a generic trace's symbols `syms` bound so
        far: what _complete and _launch would have counted."""
        trace = p.trace
        n = len(trace)
        p.pos = p.done = n
        self._steady += rounds * n
        trace.hits += rounds
        trace.strikes = 0
        self.counters.trace_hits += rounds
        self.counters.fused_launches += rounds
        self.counters.fused_ops += rounds * n
        self.counters.stream_launches += rounds
        # The outcomes collected are the oldest: those the engine knew of, then these rounds.
        known = min(collected, len(self.inflight))
        for _ in range(known):
            self.inflight.popleft()
        for r in range(collected - known, rounds):  # this match's rounds still on the stream
            self.inflight.append(p if r == 0 else Pending(trace, p.base + r * n))
        self.position = position
        if pos == 0:  # between two rounds: no match under way
            self.pending = None
            self.phase = Phase.BACKING_OFF if self._backoff else Phase.RECORDING
        else:
            current = Pending(trace, position - pos)
            current.pos = pos
            current.syms = syms
            self._match(current)

    def _arm(self) -> None:
        """After the engine answered an op of a match: the route matches the trace's next
        positions in C++, up to (not including) its last, whose completion is ours; or, where
        its launch would go to the device stream, through its last and on into its next rounds
        (Note [Armed rounds])."""
        p = self.pending
        if (self.phase is not Phase.MATCHING or self._enter_at is not None
                or self.config.launch_blocking or not self.config.native_match):
            return
        # Note [Armed matching while detecting]: before detection pauses, the positions matched
        # here go into its history at the next entry (one trace's ops at most, so no rounds):
        # their keys pushed by the route as it matches (Note [Detection fed by the route]), or,
        # where it cannot push them, once detection has gone a while without finding anything.
        feeds = self._steady < self._pause_after
        trace = p.trace
        keys = self._keys_to_push(trace) if feeds else None
        if feeds and keys is None and self._fruitless < _QUIET_BEFORE_FEEDING * len(trace):
            return  # detection is finding units now: it must see each op as it comes
        if p.done == p.pos:
            return
        table = trace.guard_table
        if table is None:
            table = trace.guard_table = _guard_table(trace)
        if table is False:
            return
        # Note [Armed rounds]: the route completes the trace too, where _launch would submit it
        # to the device stream, and goes on into its next rounds (a shape-generic trace's
        # binding its symbols anew, and noting the sizes each met as _complete does).
        wrap = (not feeds and p.done == 0 and stream.enabled() and _may_use_stream(trace)
                and not profiler_enabled() and None not in trace.sources)
        stop = len(trace.protos) - (0 if wrap else 1)
        if p.pos >= stop or None in trace.sources[p.pos:stop]:
            return
        # Known as armed before C++ is: an interrupt in between leaves a generation C++ never
        # saw, whose catch-up changes nothing.
        self._arm_generation += 1
        self._armed = p
        self._armed_feeds = feeds
        self._armed_pushes = keys is not None
        native.arm(table, p.pos, stop, self.position, self._arm_generation, wrap, p.syms, self._last_sync_at,
                   list(trace.recent_sizes) if wrap and trace.generic else [], trace.recent_sizes.maxlen,
                   *(() if keys is None else (keys, self.detector, self.shape_detector,
                                              [self._fruitless, self._fruitless_limit, self._max_pause_after,
                                               2 * self.config.repeats, self._longest_unsynced])))

    def _keys_to_push(self, trace: Trace):
        """Note [Detection fed by the route] (csrc/engine/route.cpp): each position's two detector
        keys, for the route to push as it matches (a native.FeedKeys, made once per trace and
        key tables, as is the answer None: a deep model's step re-arms after each fire); None
        where it cannot: a shape-generic trace's keys depend on the sizes each match meets, an
        op's keys were forgotten (the tables started afresh) or never taken, and while a
        size-erased period waits for its sightings (_generic_wait counts ops one by one)."""
        if trace.generic or self._generic_wait is not None:
            return None
        token = self._ids_token
        kept = trace.pushed_keys
        if kept is not None and kept[0] is token:
            return kept[1]
        keys = []
        for proto in trace.protos:
            ids = proto.ids
            if ids is None or ids[0] is not token:
                keys = None
                break
            keys.append((ids[1], ids[2]))
        if keys is not None:
            keys = native.FeedKeys(keys)
        trace.pushed_keys = (token, keys)
        return keys

    def drain(self) -> None:
        with self._lock:
            self._drain()

    def settle_before_fork(self) -> None:
        """A streamed launch still open (Note [Streamed launches]) runs on an executor the
        child will not have: it is launched, as at a sync point, and everything waited for."""
        with self._lock:
            self._flush("fork")

    def catch_up(self) -> None:
        """Count what the route matched and launched in C++ since it was armed (Note [Armed
        rounds]): stats() reads the counters after this."""
        with self._lock:  # entering it catches up
            pass

    def _drain(self) -> None:
        """Wait for the launches on the device stream; an error is raised at the next sync point."""
        while self.inflight or native.launch_in_flight():
            self._collect_oldest()

    def _collect_oldest(self) -> None:
        # One may be on the stream that self.inflight does not know of: an interrupt right
        # after its submit (the newest, so the deque's oldest is still C++'s oldest).
        p = self.inflight.popleft() if self.inflight else None
        try:
            native.finish_launch()
        except Exception as exc:
            error = exc if p is None else launch_error(p.trace, max(native.failed_index(), 0), exc)
            if self.error is None:  # the first failure: a launch reading its values fails after it
                self.error = error
            native.set_failure(str(self.error), type(self.error).__name__, True)
        if not native.launch_in_flight():
            self.inflight.clear()

    def synchronize(self, device_index) -> None:
        """An explicit sync ends the match, unlike a read: matching on after it would keep
        the launched ops' results (device memory) until the trace's next op arrives."""
        with self._lock:
            self._flush("synchronize")
            self._stop_matching()
            self._note_sync()
            if not self.detection_paused:
                # A cut of the stream, as a sync op is: in the history as a barrier, so a
                # loop that synchronizes every step gets a trace that starts right after it
                # (not at the quietest cut, which a sync would then split every step).
                self._advance(_SYNC_MARK, ())
            else:
                self.segments.forget()
            self._raise_error()

    def _host_sync(self, reason: str = "host read") -> None:
        """A host access (a copy to or from the host, item(), resize_): a sync point, and a
        cut of the stream as a sync op is (Note [Sync points])."""
        with self._lock:
            self._flush(reason)
            self._note_sync()
            if not self.detection_paused:
                self._advance(_HOST_ACCESS, ())
            else:
                self._cut_segment(self.position)
                self.position += 1
            self._raise_error()

    def route(self, func, args, kwargs) -> RouteAnswer:
        """What to do with one op (Note [The route's answers] in dispatch/executor.py)."""
        info = getattr(func, "_neuron_info", None) or classify(func)
        with self._lock:
            try:
                p = self.pending
                if p is not None and p.pos == len(p.trace.protos):  # builtin len: once per op
                    self._complete(p)  # an interrupt stopped its completion: Note [Interrupted issue]
                if self.config.launch_blocking:
                    return native.RUN_EAGER
                if (info.is_host_read or info.is_collective or info.may_resize and info.resizes_output(args, kwargs)
                        or info.has_data_dependent_shape and not info.static_shape_for(args)):
                    return self._sync_op(info, func, args, kwargs)
                out = self._fast_paths(info, func, args, kwargs)
                if out is not _NO_MATCH:
                    if self.pending is not None:
                        self._arm()
                    return out
                try:
                    rec = OpRecord.from_call(func, args, kwargs)
                except Exception:  # arguments we cannot describe: run it now
                    return self._sync_op(info, func, args, kwargs)
                return self._match_or_record(info, rec, args, kwargs)
            except Exception:
                raise
            except BaseException:
                self._end_match("interrupted")
                raise

    def issue_failed(self, reason: str = "out of memory") -> None:
        """The route could not queue an op the engine deferred: making its outputs ran out of
        device memory (they are charged at issue, where eager mode allocates them), and the
        op raises as in eager mode; or a shape-generic position's op has no shape function
        (Note [Plans from shape functions]), and it runs now. The match ends as at an
        interrupt (Note [Interrupted issue]): the op was counted, not queued."""
        with self._lock:
            self._end_match(reason)

    def _end_match(self, reason: str) -> None:
        """Note [Interrupted issue]: a KeyboardInterrupt (Ctrl-C; SystemExit too) is raised
        between any two bytecodes of the engine, so it can stop an op half matched: the
        position counted but the op not queued (route raises, the op never runs), or queued
        with its trace's completion not run. Ending the match restores what holds between
        ops: the ops really queued run (one launch, as at a divergence) and matching starts
        afresh. A completion that never ran is caught at the next op instead (route's first
        lines). Results stay eager's: the queue holds exactly the ops that were issued."""
        p = self.pending
        self._stop_matching()
        if p is not None:
            self.recent_flushes.append(f"{reason}: trace {p.trace.id} after op {p.pos} of {len(p.trace)}")
            self.counters.flushes[reason] += 1
            self._launch(p)
        self._resume_detection()

    def _fast_paths(self, info, func, args, kwargs):
        """The per-op paths that describe nothing: backing off, starting a cached trace by its
        generated first-position matcher, or matching the next position (the steady state)."""
        if self._enter_at is not None:
            return _NO_MATCH
        phase = self.phase
        if phase is Phase.MATCHING:
            p = self.pending
            if p.done != p.pos:
                return self._match_fast(p, func, args, kwargs)
        elif phase is Phase.BACKING_OFF:
            return self._run_backing_off(info, args, kwargs)
        else:
            starts = self.cache.by_first_op.get(func)
            if starts:
                return self._fast_start(starts, func, args, kwargs)
        return _NO_MATCH

    def _match_or_record(self, info, rec: OpRecord, args, kwargs):
        """The slow path: rec continues the match, starts a cached trace, or runs eagerly."""
        if self.pending is not None or self._enter_at is not None:
            out = self._continue_match(rec, args, kwargs)
            if out is not _NO_MATCH:
                return out
        out = self._try_start(rec, args, kwargs)
        if out is not _NO_MATCH:
            return out
        return self._record_eager(info, rec, args, kwargs)

    # -- matching and deferring --------------------------------------------------------------
    def _continue_match(self, rec: OpRecord, args, kwargs):
        if self._enter_at is not None and self._enter_at[1] <= self.position:
            # A longer trace was just adopted, and the stream is at its start now.
            (trace, at), self._enter_at = self._enter_at, None
            if at == self.position:
                self._flush("longer trace adopted")
                self._stop_matching()
                return self._start(trace, rec, args, kwargs)
        p = self.pending
        if p is None:
            return _NO_MATCH
        if p.done == p.pos:
            # Right after a sync point: a cached trace that starts here and runs longer than
            # the rest of this one is the better continuation (the sync is its boundary).
            for trace in self.cache.by_start.get(rec.signature, ()):
                if len(trace) > len(p.trace) - p.pos and trace is not p.trace:
                    self._stop_matching()
                    out = self._start(trace, rec, args, kwargs)
                    if out is not _NO_MATCH:
                        return out
                    self._match(p)
        out = self._match_one(p, rec, args, kwargs)
        if out is _NO_MATCH:
            out = self._switch_trace(p, rec, args, kwargs)
        if out is _NO_MATCH:
            self._diverge(p, rec)
        return out

    def _switch_trace(self, p: Pending, rec: OpRecord, args, kwargs):
        """Traces that start alike (a `t` begins many) share their first ops: when the one
        being matched diverges, another cached trace with the very same prefix (signatures
        and dataflow) that matches this op takes over the match, with everything deferred
        or launched so far. Without it the longest trace, tried first, diverged at every
        occurrence of its first op that begins a shorter trace."""
        if p.done or p.trace.generic:
            # A launched prefix freed its values by this trace's last reads; another trace
            # may read them later (a random-program search found it): no hand-over then.
            # (A generic trace's symbols are its own: none is handed over either.)
            return _NO_MATCH
        k = p.pos
        prefix = p.trace.key.parts[:k]
        streamed = native.queue_streamed()
        for trace in self.cache.by_start.get(p.trace.protos[0].signature, ()):
            if (trace is p.trace or len(trace) <= k or trace.protos[k].signature != rec.signature
                    or not _same_prefix(trace, k, prefix)):
                continue
            if streamed and not _may_use_stream(trace):  # its random ops must run on the host
                continue
            old = p.trace
            p.switch(trace)
            out = self._match_one(p, rec, args, kwargs)
            if out is not _NO_MATCH:
                self.counters.switches += 1
                return out
            p.switch(old)
        return _NO_MATCH

    def _try_start(self, rec: OpRecord, args, kwargs):
        for trace in self.cache.by_start.get(rec.signature, ()):
            out = self._start(trace, rec, args, kwargs)
            if out is not _NO_MATCH:
                self.cache.get(trace.key)  # touch: recently used
                return out
        for trace in self.cache.by_first_op.get(rec.func, ()):
            if trace.generic:
                out = self._start(trace, rec, args, kwargs)
                if out is not _NO_MATCH:
                    self.cache.get(trace.key)
                    return out
        return _NO_MATCH

    def _start(self, trace, rec, args, kwargs):
        if not trace.generic and trace.protos[0].signature != rec.signature:
            return _NO_MATCH
        p = Pending(trace, self.position)
        self._match(p)
        out = self._match_one(p, rec, args, kwargs)
        if out is _NO_MATCH:
            self._stop_matching()
        return out

    def _fast_start(self, starts, func, args, kwargs):
        """Start matching a cached trace with its generated first-position matcher: the
        steady-state way into a trace, without describing the call as an OpRecord. The
        matcher checks what the signature holds, so it accepts exactly what _try_start would."""
        for trace in starts:
            p = Pending(trace, self.position)
            self._match(p)
            out = self._match_fast(p, func, args, kwargs)
            if out is not _NO_MATCH:
                self.cache.get(trace.key)  # touch: recently used
                return out
        self._stop_matching()
        return _NO_MATCH

    def _match_fast(self, p: Pending, func, args, kwargs, rec: OpRecord | None = None):
        """Match the next position with its generated matcher (compile.py, native=True): the
        call's metadata against the signature, without describing it as an OpRecord; or, while
        the position is cold, by describing it (Note [Matchers compiled once warm])."""
        k = p.pos
        trace = p.trace
        proto = trace.protos[k]
        if proto.info.op is not func:
            return _NO_MATCH
        match = proto.matcher
        if match is None:
            if proto.interpreted < INTERPRETED_MATCHES:
                proto.interpreted += 1
                if rec is None:
                    try:
                        rec = OpRecord.from_call(func, args, kwargs)
                    except Exception:  # no signature describes it: no trace holds it (route runs it now)
                        return _NO_MATCH
                fits = fits_generic(proto, rec, p.syms) if trace.generic else rec.signature == proto.signature
                return self._defer(p, proto) if fits else _NO_MATCH
            match = proto.matcher = compile_generic_matcher(proto) if trace.generic else compile_matcher(proto)
        if match(args, kwargs, p) is None:
            return _NO_MATCH
        return self._defer(p, proto)

    def _match_one(self, p: Pending, rec: OpRecord, args, kwargs):
        if p.trace.generic:
            return self._match_fast(p, rec.func, args, kwargs, rec)
        proto = p.trace.protos[p.pos]
        if proto.signature != rec.signature:
            return _NO_MATCH
        return self._defer(p, proto)

    def _defer(self, p: Pending, proto):
        """Queue the op at p.pos (the C++ route does it with the plan returned here)."""
        if self._steady >= self._pause_after:  # detection_paused, inline: once per op
            position = self.position
            self.position += 1
        else:
            position = self._advance(GenericSighting(proto, p.syms) if p.trace.generic else proto, _MATCHED)
        p.positions.append(position)
        if p.trace.sources[p.pos] is None:
            p.trace.sources[p.pos] = user_source_line() or "(autograd engine)"
        if p.pos == 0 and stream.enabled() and _may_use_stream(p.trace) and not profiler_enabled():
            # Note [Streamed launches] (csrc/engine/queue.cpp): on the device as it is issued,
            # if there is room on the stream once what has ended is collected (no wait here:
            # else it is submitted whole at its end, as before).
            while native.launches_in_flight() >= native.STREAM_DEPTH and native.oldest_launch_ended():
                self._collect_oldest()
            native.stream_next(True)
        elif p.pos == 0:
            native.stream_next(False)
        p.pos += 1
        if p.complete:  # launched once the route has queued this last op
            return proto.plan, lambda: self._after_last_op(p)
        return proto.plan

    def _after_last_op(self, p: Pending) -> None:
        with self._lock:
            try:
                if self.pending is p:
                    self._complete(p)
            except Exception:
                raise
            except BaseException:  # Note [Interrupted issue]
                self._end_match("interrupted")
                raise

    def _complete(self, p: Pending) -> None:
        self._steady += len(p.trace)
        p.trace.hits += 1
        p.trace.strikes = 0
        if p.trace.generic:
            p.trace.note_sizes(p.syms)
        self.counters.trace_hits += 1
        self._launch(p)
        self._stop_matching()

    def _diverge(self, p: Pending, rec: OpRecord) -> None:
        expected = p.trace.protos[p.pos]
        self.counters.divergences += 1
        p.trace.divergences += 1
        where = user_source_line() or "(autograd engine)"
        if p.trace.generic:
            differs = generic_difference(expected, rec, p.syms)
        else:
            differs = signature_difference(expected.signature, rec.signature)
        if expected.info.op is rec.func:  # the same op: say which argument differed
            differs = f"{expected.name} with {differs}" if differs else f"{expected.name} (its dataflow differed)"
        self.recent_divergences.append(f"trace {p.trace.id} at op {p.pos + 1} of {len(p.trace)}: {differs} at {where}")
        # Note [A diverging trace yields its start]
        # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        # Traces that start alike are tried longest first, and a match that diverges hands
        # over to another with the same prefix (_switch_trace), but not once part of it has
        # launched (at a sync point inside it). Two phases whose steps start alike and part
        # after a sync (a server's prefill steps and decode steps: the same input preparation,
        # then different token counts) then had the longer trace tried first at every step of
        # the other phase, diverging each time, so the other phase's trace was adopted but
        # never reached (0 hits; 40 launches per decoded token of a 2-layer Llama served by
        # vLLM). The trace that diverged goes behind the others that start alike: the next
        # step tries the trace the stream last followed first, and a change of phase costs
        # one divergence instead of one per step.
        key = (p.trace.id, p.pos)
        if self._quiet_until is None:
            self._fruitless_divergences.add(key)
        elif key not in self._familiar_divergences:
            self._quiet_until = self.position  # not where it left them before: look again
        self.cache.demote(p.trace)
        if self.detection_paused:
            self._segment_prefix(p)
        self._flush("divergence")
        self._stop_matching()
        self._resume_detection()
        if p.trace.generic and differs_in_sizes_only(expected, rec):
            self._sizes_parted(p.trace)
        p.trace.strikes += 1
        if p.trace.strikes >= _RETIRE_STRIKES:
            self._retire(p.trace)

    def _sizes_parted(self, trace: Trace) -> None:
        """Note [Sizes that parted]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~
        A generic trace relates sizes as its two sightings did (Note [Shape-generic traces]):
        two sizes that changed alike there are one symbol, one that did not change is a
        constant. Two caches can change alike for a while and then part: Gemma2's sliding-
        window layers' cache grows with the full-attention layers' until the window is full,
        then stays. The trace adopted before then diverges at every token after, where the
        sizes part; the size-erased stream goes on repeating with the same period, so its
        detector did not fire again, and the token ran unfused until the trace retired
        (eight tokens). So a divergence on sizes alone (the same op, arguments of the same
        structure) asks the size-erased period to fire once more at the next op: its two
        latest sightings, taken at the step's next cut (_plan_generic), relate the sizes as
        they go now, and become a trace tried before the one that diverged (_demote_parted).
        Sightings that relate them as before rebuild the same key, which is cached already:
        nothing is adopted, and the next divergence asks again. (Not while detection is
        paused: the next op is not pushed, and the request would fire at a later, unrelated run.)"""
        if trace.shape_period and not self.detection_paused:
            self.shape_detector.fire_again(trace.shape_period, after=1)

    def _demote_parted(self, trace: Trace) -> None:
        """Note [Sizes that parted]: a generic trace just adopted goes ahead of those of its
        length and first op that diverged since they last completed (adding it sorted it
        behind them, undoing their demotion): the stream left them, and trying them first
        cost one more token op by op."""
        for other in list(self.cache.by_first_op.get(trace.protos[0].info.op, ())):
            if other is not trace and other.generic and other.strikes and len(other) == len(trace):
                self.cache.demote(other)

    def _retire(self, trace: Trace) -> None:
        """Note [A trace that keeps diverging retires]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        A trace entered where it does not continue costs a launch of what it queued and a
        divergence each time, and worse, can keep the step's own trace from ever being found.
        Two signs retire one (evicted, its key remembered so that detection does not adopt it
        again):
        - it blocked a longer unit: a period fired whose window holds ops a shape-generic trace
          matched and whose exact signature never ran eagerly, so the unit cannot be described
          (_adopt), and it diverges once for every two completions or more (_blocking). Qwen3's q/k norm (7 ops) was entered at every matmul of the step, so the
          MLP's matmuls never ran eagerly, and its 349-op step ran as 101 launches. The period
          fires again two periods later (PeriodDetector.fire_again); once the blocker has
          retired, those ops run eagerly and are recorded, and it is adopted: one launch a step.
        - it diverged _RETIRE_STRIKES times in a row with no completion between: a trace of an
          earlier phase or model that the stream no longer follows. One that completes now and
          then (a step's trace also entered at a copy of its first op inside the step; a
          generate() call's trace diverging once, at its last token) never retires.
        A new model or phase has other signatures, so other keys: it inherits nothing."""
        self.cache.remove(trace)
        self.retired[trace.key] = None
        if len(self.retired) > _RETIRED_KEPT:
            self.retired.popitem(last=False)
        self.recent_retired.append(trace)
        if self._enter_at is not None and self._enter_at[0] is trace:
            self._enter_at = None

    def _resume_detection(self) -> None:
        """The stream left the cached traces: look for repetition again, from here on."""
        if self._quiet_until is not None:
            if self.position < self._quiet_until:
                self._steady = max(self._steady, self._pause_after)  # Note [Detection that finds nothing pauses]
                return
            self._quiet_until = None
            self._fruitless_limit = min(2 * self._fruitless_limit, self._max_pause_after)
            self._quiet_factor = min(_QUIET_FACTOR * self._quiet_factor, _MAX_QUIET_FACTOR)
        if self.detection_paused:
            self.history.clear()
            self.detector.forget()
            # Note [When detection pauses]: it paused too soon if this recurs every step (a
            # deep model's identical layers matched back to back, then its head diverging):
            # wait twice as long before the next pause, up to what the longest unit needs.
            # No unit is longer than the longest stretch between sync points: generate()
            # reads the host every token and ends each call with a divergence, and doubling
            # on that had detection never pause again (half the engine's cost per token).
            unit = max(self._longest_unsynced, self.position - self._last_sync_at)
            limit = max(_MIN_PAUSE_AFTER, min(self._max_pause_after, 2 * self.config.repeats * unit))
            self._pause_after = min(2 * self._pause_after, limit)
            self._longest_unsynced = 0
        self._steady = 0

    # -- launching ----------------------------------------------------------------------------
    def _launch(self, p: Pending) -> None:
        if native.queue_streamed():  # on the stream since its first op: Note [Streamed launches]
            n = p.pos - p.done
            native.submit_queue()  # seals it
            self.inflight.append(p)
            p.done = p.pos
            self.counters.fused_launches += 1
            self.counters.fused_ops += n
            self.counters.stream_launches += 1
            if not p.complete:  # a prefix, launched as run_queue would: its error ends the match
                self._drain()
                if self.error is not None:
                    self._stop_matching()
            return
        if p.done == 0 and p.complete and stream.enabled() and _may_use_stream(p.trace) and not profiler_enabled():
            # Up to STREAM_DEPTH launches on the stream, which runs them in order.
            while native.launches_in_flight() >= native.STREAM_DEPTH:
                self._collect_oldest()
            if native.submit_queue():  # Note [The device stream] (csrc/engine/queue.cpp)
                self.inflight.append(p)
                p.done = p.pos
                self.counters.fused_launches += 1
                self.counters.fused_ops += len(p.trace)
                self.counters.stream_launches += 1
            return
        if self.inflight or native.launch_in_flight():
            self._drain()
        start = p.done
        try:
            n = native.run_queue() if not profiler_enabled() else _run_queue_profiled(p)
        except Exception as exc:  # an op's own error: raised at the next sync point
            k = start + max(native.failed_index(), 0)
            self.error = launch_error(p.trace, k, exc)
            native.set_failure(str(self.error), type(self.error).__name__, True)
            p.pos = p.done = k
            self._stop_matching()
            return
        p.done = p.pos
        if n:
            self.counters.fused_launches += 1
            self.counters.fused_ops += n

    def _flush(self, reason: str) -> None:
        """A sync point: launch everything pending (matching, if any, continues after the
        launched prefix), then wait for the launch on the device stream."""
        if profiler_enabled():  # a sync point is a range even when nothing was pending
            p = self.pending
            with sync_range(reason, 0 if p is None else p.pos - p.done):
                self._flush_pending(reason)
                self._drain()
            return
        self._flush_pending(reason)
        self._drain()

    def _flush_pending(self, reason: str) -> None:
        p = self.pending
        if p is None or p.done == p.pos:
            return
        self.counters.flushes[reason] += 1
        self.recent_flushes.append(f"{reason}: trace {p.trace.id} after op {p.pos} of {len(p.trace)}")
        self._launch(p)

    def _note_sync(self) -> None:
        self._longest_unsynced = max(self._longest_unsynced, self.position - self._last_sync_at)
        self._last_sync_at = self.position

    def _raise_error(self) -> None:
        if self.error is not None:
            native.set_failure("", "", False)
            err, self.error = self.error, None
            raise err

    # -- ops that run now -------------------------------------------------------------------
    def _sync_op(self, info, func, args, kwargs):
        self._flush(f"sync: {info.name}")
        self._note_sync()
        self._raise_error()
        if not self.detection_paused:
            try:
                signature = OpRecord.from_call(func, args, kwargs).signature
            except Exception:  # undescribable arguments: the op stays out of the history
                self.detector.forget()
                self.segments.forget()
                return native.RUN_EAGER
            barrier = self.barriers.get(signature)
            if barrier is None:
                barrier = self.barriers[signature] = _Barrier(signature, info.name)
            self._advance(barrier, ())
        else:
            self._cut_segment(self.position)
            self.position += 1
        return native.RUN_EAGER

    def _run_backing_off(self, info, args, kwargs):
        if self.inflight:
            self._drain()
        self.segments.forget()  # ops it does not count (the position stays)
        if self._backed_off():
            self.history.clear()
            self.detector.forget()
        return native.RUN_EAGER

    def _record_eager(self, info, rec: OpRecord, args, kwargs):
        if self.pending is not None:  # an op between a sync and the trace's rest: launch first
            self._flush("divergence")
            self._stop_matching()
        if self._quiet_until is not None:
            proto = self.protos.get(rec.signature)
            if proto is not None and self.position < self._quiet_until:
                # Note [Detection that finds nothing pauses]: an op seen before, run as ever,
                # with nothing to describe or detect but its segment (Note [Segments that recur apart]).
                self._segment_unrecorded(proto)
                self.position += 1
                return native.RUN_EAGER
            self._quiet_until = self.position  # an op never seen: the quiet pause ends here
        return native.RUN_EAGER, lambda out: self._recorded(info, rec, out, args, kwargs)

    def _recorded(self, info, rec: OpRecord, out, args, kwargs) -> None:
        """The route ran a recorded op on the eager path: into the history with its results."""
        with self._lock:
            self._resume_detection()
            try:
                proto = self._proto(info, rec, out, args, kwargs, barrier=False)
                producer_of = native.producer_of
                inputs = tuple(producer_of(v) if isinstance(v, torch.Tensor) and not v.is_cpu else None
                               for v in rec.values)
                position = self._advance(proto, inputs)
                if not proto.barrier:  # its output slots are its out_specs (a barrier's may not be)
                    for slot, o in enumerate(output_slots(info, out, args, kwargs)):
                        native.note_producer(o, position, slot)
            except Exception as exc:
                self._warn(exc)

    def _count_novelty(self, new_signature: bool) -> None:
        """Back off from recording while most ops have never-seen signatures (shapes that
        never repeat): recording them costs ~1.5x eager and cannot find a trace."""
        self._window_ops += 1
        self._window_novel += new_signature
        # After a backoff, a short sample decides whether the stream is still new.
        if self._window_ops < (_NOVELTY_SAMPLE if self._novel_windows >= 2 else _NOVELTY_WINDOW):
            return
        if 4 * self._window_novel > self._window_ops:  # over a quarter never seen before
            self._novel_windows += 1
            if self._novel_windows >= 2:  # a program's first ops are all new: not a sign
                self._back_off(self._backoff_len)
                self._backoff_len = min(4 * self._backoff_len, _MAX_BACKOFF)
        else:
            self._novel_windows = 0
            self._backoff_len = _NOVELTY_WINDOW
        self._window_ops = self._window_novel = 0

    def _proto(self, info, rec, out, args, kwargs, barrier: bool):
        proto = self.protos.get(rec.signature)
        if proto is None:
            proto = self.protos[rec.signature] = build_proto(info, rec, out, args, kwargs)
            # New sizes of a known op sequence that has been repeating (a growing cache) are
            # no novelty: the shape detector is about to find it (Note [Shape-generic traces]).
            # New sizes in an order that never repeats are, as ever.
            self._count_novelty(erased_signature(proto) not in self.erased_ids
                                or self.shape_detector.longest_run() < _SHAPES_REPEATING)
        else:
            self._count_novelty(False)
        return proto

    # -- history and detection ----------------------------------------------------------------
    def _advance(self, proto, producers, pushed: tuple | None = None) -> int:
        """Append one op to the history; adopt traces when a period fires. Returns its position.
        pushed: the route pushed its keys already, and the detectors answered these periods
        (Note [Detection fed by the route])."""
        position = self.position
        self.position += 1
        if self._steady >= self._pause_after:  # detection_paused, inline: once per op
            return position  # detection paused: the stream is fully covered by traces
        self.history.append((position, proto, producers))
        self._fruitless += 1
        ids = proto.ids  # a GenericSighting's are None: it is new per match
        if ids is not None and ids[0] is self._ids_token:
            key, shape_key, new_sizes_only = ids[1], ids[2], False
        else:
            key, shape_key, new_sizes_only = self._key_ids(proto)
        if new_sizes_only:
            self._found_something()  # an op never seen, but for its sizes
        elif self._fruitless >= self._fruitless_limit:
            self._maybe_quiet()
        if pushed is None:
            period = self.detector.push(key)
            shape_period = self.shape_detector.push(shape_key)
        else:
            period, shape_period = pushed
        if period is not None:
            self._adopt(period)
        elif shape_period is not None and self._generic_wait is None and self.config.generic_traces:
            self._plan_generic(shape_period)
        if proto.barrier:
            self._cut_segment(position)
        else:
            self.segments.push((position, proto, producers), key)
        if self._generic_wait is not None:
            period, wait = self._generic_wait
            if wait:
                self._generic_wait = (period, wait - 1)
            else:
                self._generic_wait = None
                self._adopt_generic(period)
        return position

    def _key_ids(self, proto) -> tuple[int, int, bool]:
        """The detectors' keys of a history entry's op: its exact signature's and its size-erased
        one's, interned, and whether the size-erased one is new. Kept on a proto or barrier
        (protos are interned by signature) with the token of the tables they index, so an op
        seen before pays no hash of its nested signatures (two an op, ~1-3 us, of the ~6 the
        history costs an op while detecting)."""
        # An op a generic trace matched is keyed as the same op run eagerly would be: the
        # exact detector sees one stream however its ops were matched.
        signature = proto.exact_signature() if type(proto) is GenericSighting else proto.signature
        key = self.key_ids.get(signature)
        if key is None:
            if len(self.key_ids) > _KEYS_KEPT:  # never-repeating streams: keep memory bounded
                self.key_ids.clear()
                self.protos.clear()
                self._ids_token = object()  # every id kept on a proto is stale now
            key = self.key_ids[signature] = len(self.key_ids)
        erased = erased_signature(proto)
        shape_key = self.erased_ids.get(erased)
        new_sizes_only = shape_key is None
        if new_sizes_only:
            if len(self.erased_ids) > _KEYS_KEPT:
                self.erased_ids.clear()
                self._ids_token = object()
            shape_key = self.erased_ids[erased] = len(self.erased_ids)
        if type(proto) is not GenericSighting:
            proto.ids = (self._ids_token, key, shape_key)
        return key, shape_key, new_sizes_only

    # -- Note [Detection that finds nothing pauses] ---------------------------------------------
    def _found_something(self) -> None:
        """A new trace was cached, or an op never seen (but for its sizes) ran: detection has
        work, and pauses for lack of it only after a full stretch again."""
        self._fruitless = 0
        self._fruitless_limit = _MIN_PAUSE_AFTER
        self._quiet_factor = _QUIET_FACTOR
        self._fruitless_divergences.clear()
        self._familiar_divergences = frozenset()

    def _maybe_quiet(self) -> None:
        """Note [Detection that finds nothing pauses]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        Detection pauses after a long stretch matched inside cached traces (Note [When
        detection pauses]); a stream that leaves them now and then for good, though, kept it
        running for ever: generate() diverges once per call (its last token sets the done
        flag) and runs a dozen ops between its traces, so no stretch was long enough, and
        every op paid for recording and detection, and for matching in Python (armed
        matching waits for a pause): adaptive mode was twice eager's cost per call.
        So detection also pauses once it has seen `limit` ops in which it found nothing new
        (no trace cached, no op never seen but for its sizes) and the stream left the traces
        only where it has before: a "quiet" pause. It is long enough to find any unit it
        could find: a unit repeats within 2 * repeats of the longest stretch between sync
        points (a training step without a host read never pauses so), and at least 1,024 ops.
        While quiet, an op run eagerly whose signature is known is run with nothing recorded,
        and a divergence where the stream diverged in that stretch (the same trace and
        position) does not resume detection. An op never seen, or a divergence elsewhere (a
        call whose steps differ: its trace is found again, and the traces it diverges from
        are not retired for it), ends the pause at once; else it ends after 4 x limit ops, and
        detection looks again for twice as long before the next one (a unit longer than what
        it saw is found then: never fused is not for ever), which lasts 4 times as long again
        (up to 1,024 x limit): a stream that stays the same spends ever less of its ops on
        detection (a fixed 4 x limit left a fifth of generate()'s calls detected)."""
        unit = max(self._longest_unsynced, self.position - self._last_sync_at)
        limit = max(self._fruitless_limit, min(self._max_pause_after, 2 * self.config.repeats * unit))
        if self._fruitless < limit:
            return
        self._fruitless = 0
        # Those of earlier fruitless stretches too: a loop whose calls differ in a cycle (one
        # prompt of five padded) diverges in one call where it does not in the others.
        self._familiar_divergences = self._familiar_divergences | self._fruitless_divergences
        self._fruitless_divergences.clear()
        self._quiet_until = self.position + self._quiet_factor * limit
        self._steady = max(self._steady, self._pause_after)
        self.counters.quiet_pauses += 1

    def _drop_superseded(self, window, length: int) -> None:
        """Generic traces that matched inside a unit just cached whole (a layer of each width
        in a training step, the rotary embedding of queries and then keys in a token) are
        superseded by it, and so are shorter ones never matched at all (adopted inside such a
        unit before it had repeated): evicted, so they neither compete with it nor fill
        explain(). A phase they belong to that comes back adopts them again."""
        matched = {e[1].proto.trace for e in window if type(e[1]) is GenericSighting}
        current = None if self.pending is None else self.pending.trace
        for trace in [t for starts in self.cache.by_first_op.values() for t in starts]:
            if trace.generic and len(trace) < length and trace is not current and (trace in matched or not trace.hits):
                self.cache.remove(trace)

    def _exact_entries(self, entries):
        """History entries of a period with each op a generic trace matched as its exact proto:
        known from its eager run, or, if it never ran eagerly with those sizes and the generic
        trace meets the same sizes again and again, made from the generic position (exact_proto:
        Note [An exact proto from a generic position]). None where a generic trace whose sizes
        keep changing matched an op never run eagerly: an exact trace of these sizes would be
        entered at the next token of a decode loop and diverge where the cache has grown."""
        if not any(type(e[1]) is GenericSighting for e in entries):
            return entries
        out = []
        for e in entries:
            if type(e[1]) is GenericSighting:
                signature = e[1].exact_signature()
                proto = self.protos.get(signature)
                if proto is None:
                    if not e[1].proto.trace.sizes_repeat:
                        return None
                    proto = exact_proto(e[1], signature)
                e = (e[0], proto, e[2])
            out.append(e)
        return out

    def _blocking(self, entries, period: int) -> list[Trace]:
        """The cached generic traces shorter than `period` that matched ops of `entries` whose
        exact signature never ran eagerly (what _exact_entries could not describe), and that
        diverge at least once for every two completions (and _BLOCKER_DIVERGENCES times at
        least, so that a few early divergences decide nothing): entered where they do not continue.
        (One that mostly completes, as a generate() call's per-token trace inside the call's
        period, 3 hits to a divergence, is the unit that matters, not an obstacle.)"""
        found = []
        for e in entries:
            if type(e[1]) is GenericSighting and self.protos.get(e[1].exact_signature()) is None:
                trace = e[1].proto.trace
                if (len(trace) < period and trace.divergences >= _BLOCKER_DIVERGENCES
                        and 2 * trace.divergences >= trace.hits and trace not in found
                        and trace.key in self.cache):
                    found.append(trace)
        return found

    def _plan_generic(self, period: int) -> None:
        """A period repeated by size-erased keys: its two sightings become a generic trace once
        the second one ends where a trace should: at a sync point when the step has one,
        else at the quietest cut (as _adopt rotates an exact period)."""
        entries = _tail(self.history, 2 * period)
        if len(entries) < 2 * period:
            return
        window = entries[period:]
        barriers = [i for i, e in enumerate(window) if e[1].barrier]
        if barriers:
            # The next sync point one period after the last one: the entries till then.
            wait = barriers[-1] + 1 if barriers[-1] < period - 1 else 0
        else:
            wait = _quietest_cut(entries, period)
        self._generic_wait = (period, wait)

    def _adopt_generic(self, period: int) -> None:
        """Note [Shape-generic traces]: the last two periods (the same by size-erased keys) as
        generic traces, split at sync points."""
        entries = _tail(self.history, 2 * period)
        if len(entries) < 2 * period:
            return
        first, second = entries[:period], entries[period:]
        if any(a[1].barrier != b[1].barrier for a, b in zip(first, second)):
            return
        runs, start = [], 0
        for i, e in enumerate(second + [None]):
            if e is None or e[1].barrier:
                runs.append((start, i))
                start = i + 1
        minimum = self.config.min_trace_len_between_syncs if len(runs) > 1 else self.config.min_trace_len
        adopted = None
        for lo, hi in runs:
            if hi - lo < minimum or all(e[2] is _MATCHED for e in second[lo:hi]):
                continue  # too short, or a cached trace covers it already
            if _erased_repeats(second[lo:hi]):
                # k copies of one shorter unit by erased keys (32 `x.add_(i)` with i = 0..31):
                # only the ints of arguments changed, and the whole step, an exact unit, is
                # what repeats. A generic trace of 4 would cut it into 8 launches.
                continue
            starts = _equal_parts(hi - lo, self.config.max_trace_len)  # as _cache_unit splits
            for at in (lo + i for i in starts):
                end = min(at + starts.step, hi)
                trace = build_generic_trace(first[at:end], second[at:end])
                if trace is None:
                    continue
                if trace.key in self.cache or trace.key in self.retired:
                    continue
                trace.shape_period = period
                self._cache_found(trace)
                self._demote_parted(trace)
                self.counters.generic_traces += 1
                adopted = adopted or trace
                self._pause_after = max(self._pause_after, 4 * (hi - lo))
                self._drop_superseded(second[at:end], len(trace))
        if adopted is not None and len(runs) == 1 and (self.pending is None or len(self.pending.trace) < len(adopted)):
            # The stream is at its start now. (Not while a longer trace is matched: a unit
            # repeating inside it, as rotary embeddings do for queries and keys, must not cut it.)
            self._enter_at = (adopted, self.position)
            self._enter_period = period  # Note [Armed matching while detecting]

    def _adopt(self, period: int) -> None:
        """The last `period` ops repeated: cache them as traces (split at sync points)."""
        recent = _tail(self.history, 2 * period)
        entries = self._exact_entries(recent)
        if entries is None:
            # Note [A trace that keeps diverging retires]: shorter generic traces matched ops
            # of this unit that never ran eagerly; they go, and the period, firing again, is taken.
            for trace in self._blocking(recent, period):
                self._retire(trace)
            # Look again two periods from here: the retired traces' ops will have run eagerly,
            # and a blocker not yet sure to be one will have shown more of its record.
            self.detector.fire_again(period, after=2 * period)
            return
        if len(entries) < 2 * period:
            return
        generic = {e[0] for e in recent if type(e[1]) is GenericSighting}
        window = entries[period:]
        barriers = [i for i, e in enumerate(window) if e[1].barrier]
        if barriers:
            # Rotate so the window starts right after a sync point (the stream's own cut).
            shift = barriers[0] + 1
            window = entries[shift:shift + period]
            segments, run = [], []
            for e in window:
                if e[1].barrier:
                    segments.append(run)
                    run = []
                else:
                    run.append(e)
            segments.append(run)
            minimum = self.config.min_trace_len_between_syncs
        else:
            cut = _quietest_cut(entries, period)
            window = entries[cut:cut + period]
            segments, minimum = [window], self.config.min_trace_len
        for seg in segments:
            traces = self._adopt_segment(seg, recent, generic, minimum)
            if traces is None:
                continue
            if not barriers and (self.pending is None or len(self.pending.trace) <= len(seg)):
                # The stream is periodic: the trace's first op comes `cut` ops from now.
                # (Not while a longer trace is matched: the unit repeats inside it.)
                self._enter_at = (traces[0], self.position + cut)
                self._enter_period = period  # Note [Armed matching while detecting]

    def _adopt_segment(self, seg, recent, generic: set, minimum: int) -> list[Trace] | None:
        """seg (history entries, ops a generic trace matched given as exact ones) as cached
        traces, unless it is not worth one; None if nothing new was cached. recent: the
        history entries as they are; generic: the positions a generic trace matched."""
        if len(seg) < minimum or any(e[1].device != seg[0][1].device for e in seg):
            return None
        if _repeats_shorter_unit(seg, minimum):
            return None  # k copies of a shorter unit: that unit's trace covers it
        if all(e[0] in generic for e in seg) or self._generic_covers(seg):
            # A generic trace matched all of it, or runs these very ops at any sizes: an
            # exact one would serve these sizes only. Worse, entered by its first op at
            # every step, it would diverge at the first size of another: a generate()
            # loop over five prompts repeats exactly every five calls, and that period,
            # adopted as one exact trace per token between its host reads, cost 4 to 10
            # times the launches a call.
            return None
        traces = self._cache_unit(seg)
        if traces is None:
            return None
        # What matched inside this segment: not the whole window, whose other segments
        # (a period of many sync points) hold the generic traces of other units.
        inside = {e[0] for e in seg}
        self._drop_superseded([e for e in recent if e[0] in inside], len(seg))
        self._pause_after = max(self._pause_after, 4 * len(seg))
        return traces

    # -- Note [Segments that recur apart] (segments.py) -------------------------------------------
    def _cut_segment(self, position: int) -> None:
        """A sync point at `position`: the segment it ends becomes traces if it was seen as
        often as a trace needs, though not in a row."""
        recent = self.segments.cut(position)
        if recent is None or all(e[2] is _MATCHED for e in recent):
            return  # not trusted yet, or cached traces ran all of it already
        seg = self._exact_entries(recent)
        if seg is None or self._generic_rival(seg):
            return
        generic = {e[0] for e in recent if type(e[1]) is GenericSighting}
        for trace in self._adopt_segment(seg, recent, generic, self.config.min_trace_len_between_syncs) or ():
            trace.recurs_apart = True  # its dataflow unknown where other traces matched (_same_prefix)

    def _generic_rival(self, seg) -> bool:
        """A shape-generic trace starts with seg's first op (its size-erased signature): seg is
        a piece of a loop whose sizes change (a decode token, a call's setup at one prompt
        length), whose exact sizes come back in other calls; an exact trace of it would be
        entered at other sizes and diverge (Note [Segments that recur apart])."""
        first = erased_signature(seg[0][1])
        starts = self.cache.by_first_op.get(seg[0][1].info.op, ())
        return any(t.generic and t.protos[0].erased[0] == first for t in starts)

    def _segment_key(self, signature) -> int | None:
        key = self.key_ids.get(signature)
        if key is None:  # forgotten (a never-repeating stream): the segment is not followed
            self.segments.forget()
        return key

    def _segment_unrecorded(self, proto) -> None:
        """An op a quiet pause runs without recording, at self.position: into the segment."""
        if proto.barrier:
            self._cut_segment(self.position)
            return
        key = self._segment_key(proto.signature)
        if key is not None:
            self.segments.push((self.position, proto, _UNRECORDED), key)

    def _segment_prefix(self, p: Pending) -> None:
        """A match diverges while detection is paused: the ops it matched (none launched)
        into the segment, which the ops after them continue."""
        if p.trace.generic or p.done or len(p.positions) != p.pos:
            return
        for position, proto in zip(p.positions, p.trace.protos):
            key = self._segment_key(proto.signature)
            if key is None:
                return
            self.segments.push((position, proto, _MATCHED), key)

    def _generic_covers(self, seg) -> bool:
        return any(generic_covers(t, seg) for t in self.cache.by_first_op.get(seg[0][1].info.op, ()))

    def _cache_unit(self, seg) -> list[Trace] | None:
        """seg as cached traces: one, or, when it is longer than the longest trace, the fewest
        consecutive ones, of equal length. None if all are cached already."""
        starts = _equal_parts(len(seg), self.config.max_trace_len)
        traces = [build_trace(seg[i:i + starts.step]) for i in starts]
        if any(t.key in self.retired for t in traces) or all(t.key in self.cache for t in traces):
            return None  # Note [A trace that keeps diverging retires]: not again
        for t in traces:
            if t.key not in self.cache:
                self._cache_found(t)
        return [self.cache.get(t.key, t) for t in traces]

    def _cache_found(self, trace: Trace) -> None:
        """Cache a trace detection found. News for Note [Detection that finds nothing pauses]
        only if its key was never cached before: one dropped as superseded (_drop_superseded)
        or evicted and found again is a phase coming back, as designed, not something new. A
        loop whose calls differ in a cycle (HF generate() on five prompts, one padded: its
        tokens take a longer mask path) re-adopted the same traces every few calls, each time
        as news, so detection never paused for long, and most ops were matched in Python
        (bench hf-decode: 1.8 times eager's wall time)."""
        self.cache.add(trace)
        if trace.key not in self._ever_cached:
            self._found_something()
            if len(self._ever_cached) >= _EVER_CACHED_KEPT:
                self._ever_cached.popitem(last=False)
        self._ever_cached[trace.key] = None
        self._ever_cached.move_to_end(trace.key)

    # -- failures of the engine itself ------------------------------------------------------------
    def _warn(self, exc: Exception) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"adaptive-eager: the engine failed ({type(exc).__name__}: {exc}); "
                          f"the affected ops run eagerly. Results stay correct.", RuntimeWarning, stacklevel=3)


_NO_MATCH = object()


def _tail(history: collections.deque, n: int) -> list:
    """The last n entries, oldest first, in O(n): a period fires often in a long stream
    (eight times per generate() call), and copying the whole history (up to 2 x max_period
    entries) each time was the detector's largest cost per op there."""
    tail = list(itertools.islice(reversed(history), n))
    tail.reverse()
    return tail


class _Matched(tuple):
    """The producers of an op a cached trace matched, in the history: none known (as ()),
    and telling the history that a trace covers it."""


_MATCHED = _Matched()


class _Unrecorded(tuple):
    """The producers of an op a quiet pause ran unrecorded (Note [Segments that recur apart]):
    none known (as ()); it ran eagerly, no trace covers it."""


_UNRECORDED = _Unrecorded()


def _fused_range(p: Pending):
    """The profiler range of launching p's ops [done, pos): the trace and op count, and the
    user's source lines of the first and last op when asked for (Note [Profiler ranges])."""
    trace, start, end = p.trace, p.done, p.pos
    if sources_wanted():
        name = fused_range_name(trace.id, end - start, trace.sources[start], trace.sources[end - 1])
    else:
        name = fused_range_name(trace.id, end - start)
    return profile_range(name, trace=trace.id, ops=end - start,
                         first_source=str(trace.sources[start]), last_source=str(trace.sources[end - 1]))


def _same_prefix(trace: Trace, k: int, parts: tuple) -> bool:
    """trace's first k ops are those of the trace matched (its key's first k parts: `parts`): the same
    signatures and dataflow, where trace knows it. An exact trace adopted from a segment that
    recurs apart does not know it for the ops another trace matched before diverging (their
    producers, (), in the history: Note [Segments that recur apart]); those compare by
    signature alone. Matching never checks dataflow (the queue holds the arguments), so what
    was deferred is as valid for either. Where trace knows its dataflow it must be the same:
    switching on signatures alone to exact traces of other sizes of GPT-2's tokens (a layer
    whose residual comes from elsewhere) had five prompts in turn never settle (20 to 363
    launches a call)."""
    mine = trace.key.parts[:k]
    if mine == parts:
        return True
    return trace.recurs_apart and all(a == b or (a[1] == () and a[0] == b[0]) for a, b in zip(mine, parts))


def _copies_of_shorter(keys: list, shortest: int) -> bool:
    """True if keys are several copies of a sequence of at least `shortest` keys."""
    n = len(keys)
    return any(n % q == 0 and all(keys[i] == keys[i - q] for i in range(q, n)) for q in range(shortest, n // 2 + 1))


def _erased_repeats(seg) -> bool:
    """True if the segment's size-erased keys are several copies of a shorter sequence."""
    return _copies_of_shorter([erased_signature(e[1]) for e in seg], 1)


def _repeats_shorter_unit(seg, minimum: int) -> bool:
    """True if the segment is several copies of a shorter op sequence (by signature).

    Ten training steps between two `item()` calls form one period of the stream, but the
    unit that repeats is the step."""
    return _copies_of_shorter([e[1].signature for e in seg], minimum)


def _equal_parts(length: int, longest: int) -> range:
    """Starts of the fewest equal parts of `length` ops, none longer than `longest` (the
    last may be shorter): how a unit longer than the longest trace is split."""
    size = -(-length // -(-length // longest))
    return range(0, length, size)


def _quietest_cut(entries, period: int) -> int:
    """Where to start a trace of a periodic stream: the cut with the fewest intermediate
    values live across it (in every training loop studied, the step boundary). Tensors
    updated in place (parameters, optimizer state) outlive every cut and do not count.
    entries holds two periods; returns an offset in [0, period)."""
    base = entries[0][0]
    span: dict[tuple, tuple[int, int]] = {}  # value -> (producer offset, longest distance)
    for t in range(period, 2 * period):
        position = entries[t][0]
        for prod in entries[t][2]:
            if prod is None:
                continue
            distance = position - prod[0]
            if not 0 < distance < period:
                continue
            specs = entries[prod[0] - base][1].out_specs  # none known for an exact_proto: no cut counts it
            if prod[1] < len(specs) and specs[prod[1]][0] == "new":
                a = (prod[0] - base) % period
                old = span.get(prod)
                if old is None or old[1] < distance:
                    span[prod] = (a, distance)
    live = [0] * (period + 1)  # difference array over cuts; a value spans cuts a+1..a+d
    for a, d in span.values():
        lo, hi = a + 1, a + d
        if hi < period:
            live[lo] += 1
            live[hi + 1] -= 1
        else:
            if lo < period:
                live[lo] += 1
                live[period] -= 1
            live[0] += 1
            live[hi - period + 1] -= 1
    counts, running = [], 0
    for c in range(period):
        running += live[c]
        counts.append(running)
    quietest = [c for c in range(period) if counts[c] == min(counts)]
    # Several cuts equally quiet (views are not recorded, so the values
    # they carry count only at their bytes' producers): the one that starts the longest run
    # of busier cuts, i.e. the trace starts where its longest chain of dataflow starts. In a
    # training step that is the forward (forward, backward and the optimizer's reads of the
    # gradients are one chain), not the optimizer's quiet moment between its own updates.
    def run_after(i: int) -> int:
        return (quietest[(i + 1) % len(quietest)] - quietest[i] - 1) % period
    return quietest[max(range(len(quietest)), key=lambda i: (run_after(i), -i))]


def _run_queue_profiled(p: Pending) -> int:
    """run_queue() inside the launch's fused range, its device time nested at the end
    (Note [Profiler ranges])."""
    with _fused_range(p):
        if native.timeline_recording():  # the launch's name on the device's track
            native.label_next_launch(fused_range_name(p.trace.id, p.pos - p.done))
        try:
            return native.run_queue()
        finally:  # a failed launch still ran (and charged) the ops before the failing one
            device_us, ops = native.last_fused_launch()
            mark_device_time(device_us, ops=ops, device=p.trace.device)


def _may_use_stream(trace) -> bool:
    """Its launches may run on the device stream: only C++ kernels, and no random numbers
    (native_dropout draws from torch's default generator lent the state it was issued with,
    which must happen while the host waits: Note [Deferred random ops draw at issue])."""
    ok = trace.stream_ok
    if ok is None:
        ok = trace.stream_ok = all(
            not p.info.is_random and p.info.op._schema.name.startswith(("aten::", "prims::")) for p in trace.protos)
    return ok
