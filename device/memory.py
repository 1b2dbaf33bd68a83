"""Memory accounting of one emulated device, as Python reads it.

The bytes of a device tensor come from the neuron allocator (csrc/runtime/memory.cpp), which charges
them to their device from allocation until the storage frees them, with the capacity, the
peak and the OOM error: Note [Device memory accounting] in csrc/runtime/memory.cpp.
"""
from __future__ import annotations

from . import native


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} bytes"


class DeviceMemory:
    """Device `index`'s memory: its numbers, all from the C++ accounting."""

    def __init__(self, index: int, capacity: int):
        self.index = index
        self.device_name = f"neuron:{index}"
        self.capacity = capacity

    # -- the numbers, all from the C++ accounting --------------------------------------------
    def _stat(self, name: str) -> int:
        return native.memory_stats(self.index)[name]

    @property
    def allocated(self) -> int:
        return self._stat("allocated")

    @property
    def peak(self) -> int:
        return self._stat("peak")

    @property
    def num_allocs(self) -> int:
        return self._stat("num_allocs")

    @property
    def num_frees(self) -> int:
        return self._stat("num_frees")

    @property
    def num_ooms(self) -> int:
        return self._stat("num_ooms")

    def reset_peak(self) -> None:
        native.reset_peak(self.index)

    @property
    def limit(self) -> int:
        """What this process may allocate: capacity times the per-process memory fraction."""
        return self._stat("limit")

    def set_fraction(self, fraction: float) -> None:
        native.set_memory_fraction(self.index, float(fraction))

    def stats(self) -> dict:
        """CUDA's keys, flat, and TorchNeuron's beside them (its memory_stats(): a dict per byte
        figure, and its counters). No cache: reserved and active bytes are the allocated ones,
        as memory_reserved() says. Accumulated figures (a dict's "allocated" and "freed", the
        counts) restart at reset_accumulated_memory_stats(), peaks at reset_peak_memory_stats()."""
        s = native.memory_stats(self.index)
        cuda = {
            "allocated_bytes.all.current": s["allocated"],
            "allocated_bytes.all.peak": s["peak"],
            "allocated_bytes.all.allocated": s["bytes_allocated"],
            "allocated_bytes.all.freed": s["bytes_freed"],
            "reserved_bytes.all.current": s["allocated"],
            "reserved_bytes.all.peak": s["peak"],
            "active_bytes.all.current": s["allocated"],
            "active_bytes.all.peak": s["peak"],
            "num_alloc_retries": 0,
            "num_ooms": s["num_ooms"],
            "allocation.all.allocated": s["num_allocs"],
            "allocation.all.freed": s["num_frees"],
            "allocation.all.current": s["live"],
            "capacity_bytes": s["capacity"],
        }

        def figure() -> dict[str, int]:
            return {"current": s["allocated"], "peak": s["peak"], "allocated": s["bytes_allocated"],
                    "freed": s["bytes_freed"]}

        torch_neuronx = {
            "allocated_bytes": figure(),
            "reserved_bytes": figure(),
            "active_bytes": figure(),
            "num_tensor_frees": s["num_frees"],
            "allocation_requests": s["num_allocs"],
        }
        return {**cuda, **torch_neuronx}

    def summary_table(self) -> str:
        """The table of TorchNeuron's memory_summary(): counts, then each byte figure."""
        s = self.stats()
        rule = "=" * 75
        lines = [rule, f"  Neuron Memory Summary, Device {self.index}", rule,
                 f"  Allocations: {s['allocation_requests']:,}  |  Frees: {s['num_tensor_frees']:,}",
                 f"  OOMs: {s['num_ooms']:,}  |  Alloc Retries: {s['num_alloc_retries']:,}", rule,
                 "  Metric              | Current    | Peak       | Allocated  | Freed", "-" * 75]
        for name, key in (("Allocated Memory", "allocated_bytes"), ("Reserved Memory", "reserved_bytes"),
                          ("Active Memory", "active_bytes")):
            f = s[key]
            lines.append(f"  {name:<18} | {format_bytes(f['current']):>10} | {format_bytes(f['peak']):>10} "
                         f"| {format_bytes(f['allocated']):>10} | {format_bytes(f['freed']):>10}")
        lines.append(rule)
        return "\n".join(lines)
