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

    def stats(self) -> dict[str, int]:
        s = native.memory_stats(self.index)
        return {
            "allocated_bytes.all.current": s["allocated"],
            "allocated_bytes.all.peak": s["peak"],
            "num_alloc_retries": 0,
            "num_ooms": s["num_ooms"],
            "allocation.all.allocated": s["num_allocs"],
            "allocation.all.freed": s["num_frees"],
            "allocation.all.current": s["num_allocs"] - s["num_frees"],
            "capacity_bytes": s["capacity"],
        }
