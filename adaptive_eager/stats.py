"""The public counters: what the emulated devices have done since the last reset."""
from __future__ import annotations

import dataclasses

from dispatch import CONTEXT


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


def stats(device=None) -> Stats:
    """Counters of `device` (an index, 'neuron:N' or torch.device), or summed over all devices."""
    runtime = CONTEXT.runtime
    if device is None:
        indices = range(runtime.device_count)
    else:
        import torch

        index = device if isinstance(device, int) else torch.device(device).index
        indices = [runtime.check_index(index)]
    devs = [runtime.devices[i] for i in indices]
    return Stats(
        ops=sum(CONTEXT.ops[i] for i in indices),
        launches=sum(d.counters.launches for d in devs),
        kernel_ops=sum(d.counters.kernel_ops for d in devs),
        transfers=sum(d.counters.transfers for d in devs),
        transfer_bytes=sum(d.counters.transfer_bytes for d in devs),
        device_time_us=sum(d.counters.device_time_us for d in devs),
        launch_overhead_us=sum(d.counters.launch_overhead_us for d in devs),
        peak_memory_bytes=max(d.memory.peak for d in devs),
        memory_bytes=sum(d.memory.allocated for d in devs),
    )


def reset_stats() -> None:
    """Zero every counter and set each device's peak memory to what is allocated now."""
    CONTEXT.runtime.synchronize(None)
    CONTEXT.runtime.reset_counters()
    CONTEXT.reset_counters()
