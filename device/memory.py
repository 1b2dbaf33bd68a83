"""Memory accounting of one emulated device.

The bytes of a device tensor live in a host (CPU) storage. We charge a storage to its
device from the moment it is tracked until the storage itself dies: a weak reference on the
storage's Python object fires then (torch keeps one Python object per StorageImpl alive as
long as the StorageImpl lives, so views keep their base's bytes counted, as on a real device).
"""
from __future__ import annotations

import threading
import weakref

import torch

from . import native


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} bytes"


class _StorageRef(weakref.ref):
    """A weak reference to a tracked storage, with what it is charged (`key`, `nbytes`,
    set by the creator: no Python __init__ on this per-allocation path)."""

    __slots__ = ("key", "nbytes")


class DeviceMemory:
    """Which host storages device `index` holds, charged to the C++ accounting (capacity,
    allocated and peak bytes, the OOM error: Note [Device memory accounting] in
    csrc/memory.cpp), which also counts what the C++ allocator allocates itself."""

    def __init__(self, index: int, capacity: int):
        self.index = index
        self.device_name = f"neuron:{index}"
        self.capacity = capacity
        self._live: dict[int, _StorageRef] = {}
        # Weak-reference callbacks run on whichever thread drops the last reference
        # (autograd's device thread included), so every update of _live takes the lock.
        # Reentrant: a callback may fire on this thread while it holds the lock.
        self._lock = threading.RLock()

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

    def reserve(self, nbytes: int) -> None:
        """Raise torch.OutOfMemoryError if nbytes more would not fit."""
        native.check_fits(self.index, nbytes)

    def track(self, storage: torch.UntypedStorage) -> None:
        """Count storage against this device until it dies; raises OOM (and counts nothing)
        if it does not fit. A storage already tracked is not counted twice, but one that
        grew in place since (resize_, out= with a larger result) is charged the growth."""
        # Hot path: once per new device tensor. One weakref subclass instance carries the
        # key and size, and one bound method is the callback: no closure per storage.
        key = storage._cdata
        nbytes = storage.nbytes()
        entry = self._live.get(key)
        if entry is not None and entry.nbytes == nbytes:
            return
        with self._lock:
            entry = self._live.get(key)
            if entry is not None:
                native.resize_charge(self.index, entry.nbytes, nbytes)  # raises OOM on growth
                entry.nbytes = nbytes
                return
            native.charge(self.index, nbytes)  # raises OOM
            ref = self._live[key] = _StorageRef(storage, self._on_free)
            ref.key = key
            ref.nbytes = nbytes

    # -- launches on the device stream (device/stream.py) -----------------------------------
    # A launch run by the stream's worker reports its intermediates' sizes (they never had a
    # Python object); the host charges them, in launch order, when the launch finishes.
    def charge_transient(self, nbytes: int) -> None:
        # The launch already ran with these bytes (the capacity was checked before it was
        # submitted): count them, never refuse them.
        native.charge(self.index, nbytes, check=False)

    def release_transient(self, nbytes: int) -> None:
        native.release(self.index, nbytes)

    def adopt_transient(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """An intermediate charged with charge_transient outlived its launch (a view of it
        left): track the storage itself from now on, instead of the charge."""
        with self._lock:
            native.uncharge(self.index, nbytes)
            self.track(storage)

    def _on_free(self, ref: "_StorageRef") -> None:
        # Runs on whichever thread dropped the storage's last reference.
        with self._lock:
            if self._live.get(ref.key) is ref:
                del self._live[ref.key]
                native.release(self.index, ref.nbytes)

    def reset_peak(self) -> None:
        native.reset_peak(self.index)

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
