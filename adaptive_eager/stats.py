"""The public counters: what the emulated devices have done since the last reset."""
from __future__ import annotations

import dataclasses

from adaptive_eager.device import native
from adaptive_eager.dispatch import CONTEXT

from .mode import SWITCH


@dataclasses.dataclass(frozen=True)
class Stats:
    """A snapshot of the counters of one device (or of all devices, summed)."""

    ops: int  # ATen ops intercepted on neuron tensors
    launches: int  # kernel launches (eager: one per op; fused: one per trace)
    kernel_ops: int  # ops executed inside those launches
    transfers: int  # host<->device and device<->device copies
    transfer_bytes: int
    device_time_us: float  # emulated device time (cost model)
    launch_overhead_us: float  # the launch-overhead part of device_time_us
    peak_memory_bytes: int
    memory_bytes: int  # currently allocated
    # the adaptive engine (all devices)
    fused_launches: int = 0  # launches that ran a cached trace (or a prefix of one)
    fused_ops: int = 0  # ops inside those launches
    traces: int = 0  # traces cached now
    trace_hits: int = 0  # traces matched to the end
    divergences: int = 0  # matches abandoned because an op differed from the trace
    trace_switches: int = 0  # matches handed over to a cached trace with the same first ops
    stream_launches: int = 0  # fused launches that ran on the device stream, beside the host
    flushes: dict = dataclasses.field(default_factory=dict)  # reason -> pending work launched early
    # projection mode (adaptive_eager.projection): host reads answered with a placeholder
    placeholder_reads: int = 0


def stats(device=None, *, wait: bool = True) -> Stats:
    """Counters of `device` (an index, 'neuron:N' or torch.device), or summed over all devices.

    A fused launch running on the device stream charges its device time when it finishes,
    so stats() first waits for it. wait=False does not (a loop that reads its counters every
    step then keeps its overlap): that launch and its ops count (they were issued), its
    device time does not yet. Memory is current either way: it is charged at issue."""
    runtime = CONTEXT.runtime
    engine = SWITCH.adaptive
    if wait:
        runtime.drain()
    else:
        engine.catch_up()
    if device is None:
        indices = range(runtime.device_count)
    else:
        import torch

        index = device if isinstance(device, int) else torch.device(device).index
        indices = [runtime.check_index(index)]
    devs = [runtime.devices[i] for i in indices]
    counters = [d.counters for d in devs]  # one read of the C++ clock per device
    # Ops are counted in C++ as they run (or are handed to the device stream); those the
    # engine still holds back in its queue were issued too.
    ops = sum(c.kernel_ops for c in counters) + sum(native.queued_ops(i) for i in indices)
    return Stats(
        ops=ops,
        launches=sum(c.launches for c in counters),
        kernel_ops=sum(c.kernel_ops for c in counters),
        transfers=sum(c.transfers for c in counters),
        transfer_bytes=sum(c.transfer_bytes for c in counters),
        device_time_us=sum(c.device_time_us for c in counters),
        launch_overhead_us=sum(c.launch_overhead_us for c in counters),
        peak_memory_bytes=max(d.memory.peak for d in devs),
        memory_bytes=sum(d.memory.allocated for d in devs),
        fused_launches=engine.counters.fused_launches,
        fused_ops=engine.counters.fused_ops,
        traces=len(engine.cache),
        trace_hits=engine.counters.trace_hits,
        divergences=engine.counters.divergences,
        trace_switches=engine.counters.switches,
        stream_launches=engine.counters.stream_launches,
        flushes=dict(engine.counters.flushes),
        placeholder_reads=native.placeholder_reads() - _placeholder_reads_at_reset[0],
    )


_placeholder_reads_at_reset = [0]  # the process-wide count (C++) when the counters were last zeroed


def reset_stats() -> None:
    """Zero every counter and set each device's peak memory to what is allocated now."""
    CONTEXT.runtime.synchronize(None)
    CONTEXT.runtime.reset_counters()
    SWITCH.adaptive.reset_counters()
    _placeholder_reads_at_reset[0] = native.placeholder_reads()


def device_time_split(stats) -> dict:
    """stats.device_time_us in parts: launch overhead, transfers, and the kernels' roofline
    time (compute or memory traffic, whichever bounds each op; the cost model keeps no
    finer split)."""
    # Exact: a transfer's cost is linear in its bytes, so the sum over transfers is the
    # cost of their total bytes.
    transfers = CONTEXT.runtime.cost.transfer_us(stats.transfer_bytes)
    overhead = stats.launch_overhead_us
    kernels = max(0.0, stats.device_time_us - overhead - transfers)  # rounding never goes negative
    return {"launch overhead": overhead, "kernels (compute/memory)": kernels, "transfers": transfers}
