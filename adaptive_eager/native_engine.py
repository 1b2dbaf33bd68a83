"""The adaptive engine on native neuron tensors (NEURON_TENSORS=native).

The same engine as engine.py (recording, period detection, the trace cache, matching, sync
points, divergence), with deferral done the way an asynchronous accelerator does it:
Note [Deferred launches] in device/csrc/queue.cpp. While adaptive mode is on, the C++ eager
path hands each op to `route` (csrc/route.cpp); an op that matches the next position of
the trace being matched is queued in C++ with the trace's output geometry (a DeferPlan) and
its results are handed out at once, as neuron tensors whose bytes the launch will make.
When the trace completes, or at a sync point, the queue runs as one launch.

What differs from the wrapper engine, and why:
- dataflow is not part of matching: a queued op holds its arguments themselves (their
  bytes, or the deferred outputs they are), so the launch reads what earlier ops wrote;
  the signature (shapes, strides, dtypes, structural arguments) fixes every output's
  geometry, which is all that is handed out early. Recorded ops still note which earlier
  op made each input, for the trace's cut (_quietest_cut);
- host reads need no Python hooks: the C++ host accesses (copies to or from the host,
  `item()`, resize_) call `_host_sync` while the engine is attached, a sync point each;
- a complete trace of C++ kernels runs on the device stream, beside the host (Note [The
  device stream] in csrc/queue.cpp); each op is priced as in eager mode, one launch
  overhead for them all (launch-boundary pricing comes next).
"""
from __future__ import annotations

import torch

from device import native, stream
from device.profiling import mark_device_time, profiler_enabled
from dispatch import classify
from dispatch.record import OpRecord, Slot, user_source_line

from .compile import compile_matcher
from .engine import _NO_MATCH, AdaptiveExecutor, _fused_range
from .pending import Pending, launch_error
from .trace import OpProto, output_slots, written_inputs


class _Barrier:
    """A sync op in the history (it ran eagerly, unseen): what the detector and _adopt read."""

    __slots__ = ("signature", "name")
    barrier = True
    device = None
    out_specs = ()

    def __init__(self, signature, name):
        self.signature = signature
        self.name = name


_HOST_ACCESS = _Barrier(("host access",), "host access")


class NativeAdaptiveExecutor(AdaptiveExecutor):
    """The engine for native tensors: `route` is what the C++ route calls per op."""

    def reset(self) -> None:
        if getattr(self, "pending", None) is not None:
            self._flush("reset")
        super().reset()
        self.barriers: dict = {}
        native.forget_producers()  # positions of the history just dropped

    # -- the route's two ends ----------------------------------------------------------------
    def attach(self) -> None:
        native.set_host_sync(self._host_sync)
        native.set_engine(self.route)

    def detach(self) -> None:
        native.set_engine(None)

    def execute(self, func, args, kwargs):
        raise AssertionError("native neuron tensors reach the engine through route(), not execute()")

    def read(self, t):
        raise AssertionError("native neuron tensors are read by the C++ eager path, not the engine")

    def _host_sync(self, reason: str = "host read") -> None:
        """A host access (a copy to or from the host, item(), resize_): a sync point, and a
        cut of the stream as a sync op is (Note [Sync points])."""
        with self._lock:
            self._flush(reason)
            if self._steady < self._pause_after:
                self._advance(_HOST_ACCESS, ())
            else:
                self.position += 1
            self._raise_error()

    def route(self, func, args, kwargs):
        info = getattr(func, "_neuron_info", None) or classify(func)
        with self._lock:
            if self.config.launch_blocking:
                return native.RUN_EAGER
            if info.is_host_read or info.has_data_dependent_shape or info.may_resize or info.is_collective:
                return self._sync_op(info, func, args, kwargs)
            out = self._fast_paths(info, func, args, kwargs)
            if out is not _NO_MATCH:
                return out
            if self.inflight is not None:  # what follows may run ops now or record them
                self._drain()
            try:
                rec = OpRecord.from_call(func, args, kwargs)
            except Exception:  # arguments we cannot describe: run it now
                return self._sync_op(info, func, args, kwargs)
            return self._match_or_record(info, rec, args, kwargs)

    # -- matching and deferring --------------------------------------------------------------
    def _start(self, trace, rec):
        if trace.protos[0].signature != rec.signature:
            return _NO_MATCH
        p = self.pending = Pending(trace, self.position)
        out = self._match_one(p, rec)
        if out is _NO_MATCH:
            self.pending = None
        return out

    def _match_fast(self, p: Pending, func, args, kwargs):
        """Match the next position with its generated matcher (compile.py, native=True): the
        call's metadata against the signature, without describing it as an OpRecord."""
        k = p.pos
        trace = p.trace
        proto = trace.protos[k]
        if proto.info.op is not func:
            return _NO_MATCH
        match = trace.native_matchers[k]
        if match is None:
            n = _slot_count((proto.args_t, tuple(proto.kwargs_t.values())))
            match = trace.native_matchers[k] = compile_matcher(proto, (None,) * n, n, native=True)
        if match(args, kwargs, p) is None:
            return _NO_MATCH
        return self._defer(p, proto)

    def _match_one(self, p: Pending, rec: OpRecord):
        proto = p.trace.protos[p.pos]
        if proto.signature != rec.signature:
            return _NO_MATCH
        return self._defer(p, proto)

    def _defer(self, p: Pending, proto):
        """Queue the op at p.pos (the C++ route does it with the plan returned here)."""
        if self._steady >= self._pause_after:
            position = self.position
            self.position += 1
        else:
            position = self._advance(proto, ())
        p.positions.append(position)
        if p.trace.sources[p.pos] is None:
            p.trace.sources[p.pos] = user_source_line() or "(autograd engine)"
        p.pos += 1
        if p.complete:  # launched once the route has queued this last op
            return proto.plan, lambda: self._after_last_op(p)
        return proto.plan

    def _after_last_op(self, p: Pending) -> None:
        with self._lock:
            if self.pending is p:
                self._complete(p)

    # -- launching ----------------------------------------------------------------------------
    def _launch(self, p: Pending) -> None:
        if self.inflight is not None:  # one launch on the stream at a time: the stream is in order
            self._drain()
        if p.done == 0 and p.complete and stream.enabled() and _may_use_stream(p.trace) and not profiler_enabled():
            if native.submit_queue():  # Note [The device stream] (csrc/queue.cpp)
                self.inflight = p
                p.done = p.pos
                self.counters.fused_launches += 1
                self.counters.fused_ops += len(p.trace)
                self.counters.stream_launches += 1
            return
        start = p.done
        try:
            n = native.run_queue() if not profiler_enabled() else _run_queue_profiled(p)
        except Exception as exc:  # an op's own error: raised at the next sync point
            k = start + max(native.failed_index(), 0)
            self.error = launch_error(p.trace, k, exc)
            native.set_failure(str(self.error), type(self.error).__name__, True)
            p.pos = p.done = k
            self.pending = None
            return
        p.done = p.pos
        if n:
            self.counters.fused_launches += 1
            self.counters.fused_ops += n

    def _drain(self) -> None:
        """Wait for the launch on the device stream; its error is raised at the next sync point."""
        p = self.inflight
        if p is None:
            return
        self.inflight = None
        try:
            native.finish_launch()
        except Exception as exc:
            self.error = launch_error(p.trace, max(native.failed_index(), 0), exc)
            native.set_failure(str(self.error), type(self.error).__name__, True)

    def _raise_error(self) -> None:
        if self.error is not None:
            native.set_failure("", "", False)
        super()._raise_error()

    # -- ops that run now -------------------------------------------------------------------------
    def _sync_op(self, info, func, args, kwargs):
        self._flush(f"sync: {info.name}")
        self._raise_error()
        if self._steady < self._pause_after:
            try:
                signature = OpRecord.from_call(func, args, kwargs).signature
            except Exception:  # undescribable arguments: the op stays out of the history
                self.detector.forget()
                return native.RUN_EAGER
            barrier = self.barriers.get(signature)
            if barrier is None:
                barrier = self.barriers[signature] = _Barrier(signature, info.name)
            self._advance(barrier, ())
        else:
            self.position += 1
        return native.RUN_EAGER

    def _run_backing_off(self, info, args, kwargs):
        if self.inflight is not None:
            self._drain()
        self._backoff -= 1
        if not self._backoff:
            self.history.clear()
            self.detector.forget()
        return native.RUN_EAGER

    def _record_eager(self, info, rec: OpRecord, args, kwargs):
        if self.pending is not None:  # an op between a sync and the trace's rest: launch first
            self._flush("divergence")
            self.pending = None
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

    def _proto(self, info, rec, out, args, kwargs, barrier: bool):
        proto = self.protos.get(rec.signature)
        self._count_novelty(proto is None)
        if proto is None:
            proto = self.protos[rec.signature] = build_native_proto(info, rec, out, args, kwargs)
        return proto


def _run_queue_profiled(p: Pending) -> int:
    """run_queue() inside the launch's fused range, its device time nested at the end, as
    the wrapper engine's _launch_profiled (Note [Profiler ranges])."""
    with _fused_range(p):
        try:
            return native.run_queue()
        finally:  # a failed launch still ran (and charged) the ops before the failing one
            device_us, ops = native.last_fused_launch()
            mark_device_time(device_us, ops=ops, device=p.trace.device)


def _may_use_stream(trace) -> bool:
    """Its launches may run on the device stream: only C++ kernels, and no random numbers
    (they come from the device generator in stream order, on the host: Note [RNG order])."""
    ok = trace.native_stream_ok
    if ok is None:
        ok = trace.native_stream_ok = all(
            not p.info.is_random and p.info.op._schema.name.startswith(("aten::", "prims::")) for p in trace.protos)
    return ok


def _slot_count(template) -> int:
    """How many values an OpRecord template binds (its Slot placeholders)."""
    if type(template) is Slot:
        return 1
    if type(template) in (list, tuple):
        return sum(_slot_count(t) for t in template)
    return 0


def build_native_proto(info, rec: OpRecord, result, args, kwargs) -> OpProto:
    """Describe an op that just ran eagerly, with the DeferPlan that queues it next time; a
    barrier (never deferred) if its results cannot be handed out before it runs."""
    device, barrier = None, False
    storages = set()
    for v in rec.values:
        if isinstance(v, torch.Tensor) and v.device.type == "neuron":
            if device is None:
                device = v.device.index
            storages.add(native.storage_of(v)[0])
        elif isinstance(v, torch.Generator):
            barrier = True  # its state must move at issue, where the user may read it
    if device is None:  # a factory: the device it names
        named = kwargs.get(info.device_arg) if info.device_arg else None
        device = named.index if isinstance(named, torch.device) and named.index is not None \
            else native.current_device()
    written = written_inputs(info, args, kwargs)
    if any(t.device.type != "neuron" for t in written):
        barrier = True  # a host tensor written by a device op: the host must see it now
    schema_returns = info.op._schema.returns
    returns = () if not schema_returns else result if len(schema_returns) > 1 else (result,)
    specs, plan_outputs, list_lengths = [], [], []

    def alias_of(t) -> tuple | None:
        index = next((i for i, v in enumerate(rec.values) if v is t), None)
        return None if index is None else ("alias", index)

    def new_output(o) -> tuple | None:
        if not isinstance(o, torch.Tensor) or o.device.type != "neuron" or o.layout != torch.strided:
            return None
        storage, nbytes = native.storage_of(o)
        if storage in storages:
            return None  # a view of an input, or of another output: aliasing a plan cannot give
        storages.add(storage)
        geometry = (tuple(o.shape), o.stride(), o.storage_offset(), o.dtype, nbytes)
        plan_outputs.append((list(geometry[0]), list(geometry[1]), geometry[2], geometry[3], geometry[4]))
        return ("new",) + geometry

    for alias, r in zip(info.return_aliases, returns):
        if alias is not None:  # an in-place or out= result: must be the written input itself
            found = [alias_of(r) if any(r is t for t in written) else None]
        elif isinstance(r, (list, tuple)):
            list_lengths.append(len(r))
            found = [new_output(o) for o in r]
        else:
            found = [new_output(r)]
        barrier |= None in found
        specs += found
    if not schema_returns:  # in place, returning nothing (_foreach_add_): the written inputs
        specs = [alias_of(t) for t in output_slots(info, result, args, kwargs)]
        barrier |= None in specs
    if barrier:
        specs = [s for s in specs if s is not None]
    proto = OpProto(info, rec.signature, rec.args, dict(rec.kwargs), tuple(specs), None, device, barrier)
    proto.plan = None if barrier else native.DeferPlan(device, plan_outputs, list_lengths)
    return proto
