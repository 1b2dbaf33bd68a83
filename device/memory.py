"""Memory accounting of one emulated device.

The bytes of a device tensor live in a host (CPU) storage. We count a storage against its
device from the moment it is tracked until the storage itself dies: a weak reference on the
storage's Python object fires then (torch keeps one Python object per StorageImpl alive as
long as the StorageImpl lives, so views keep their base's bytes counted, as on a real device).
"""
from __future__ import annotations

import threading
import weakref

import torch


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
    """Allocated/peak bytes of one device, with a capacity and a CUDA-like OOM error."""

    def __init__(self, device_name: str, capacity: int):
        self.device_name = device_name
        self.capacity = capacity
        self.allocated = 0
        self.peak = 0
        self.num_allocs = 0
        self.num_frees = 0
        self.num_ooms = 0
        self._live: dict[int, _StorageRef] = {}
        # Weak-reference callbacks run on whichever thread drops the last reference
        # (autograd's device thread included), so every update takes the lock. Reentrant:
        # a callback may fire on this thread while it holds the lock.
        self._lock = threading.RLock()

    def reserve(self, nbytes: int) -> None:
        """Raise torch.OutOfMemoryError if nbytes more would not fit."""
        if self.allocated + nbytes > self.capacity:
            self.num_ooms += 1
            free = self.capacity - self.allocated
            raise torch.OutOfMemoryError(
                f"{self.device_name} out of memory. Tried to allocate {format_bytes(nbytes)}. "
                f"{self.device_name} has a total capacity of {format_bytes(self.capacity)}, of which "
                f"{format_bytes(self.allocated)} is already allocated and {format_bytes(free)} is free. "
                f"Free tensors you no longer need (drop every reference to them), use a smaller batch, "
                f"or raise the capacity with NEURON_DEVICE_MEMORY.")

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
                self._grow(entry, nbytes)
                return
            if self.allocated + nbytes > self.capacity:
                self.reserve(nbytes)  # raises
            ref = self._live[key] = _StorageRef(storage, self._on_free)
            ref.key = key
            ref.nbytes = nbytes
            self.allocated += nbytes
            self.num_allocs += 1
            if self.allocated > self.peak:
                self.peak = self.allocated

    # -- launches on the device stream (device/stream.py) -----------------------------------
    # A launch run by the stream's worker reports its intermediates' sizes (they never had a
    # Python object); the host charges them, in launch order, when the launch finishes.
    def charge_transient(self, nbytes: int) -> None:
        with self._lock:
            self.allocated += nbytes
            self.num_allocs += 1
            if self.allocated > self.peak:
                self.peak = self.allocated

    def release_transient(self, nbytes: int) -> None:
        with self._lock:
            self.allocated -= nbytes
            self.num_frees += 1

    def adopt_transient(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """An intermediate charged with charge_transient outlived its launch (a view of it
        left): track the storage itself from now on, instead of the charge."""
        with self._lock:
            self.allocated -= nbytes
            self.num_allocs -= 1
            self.track(storage)

    def _grow(self, entry: "_StorageRef", nbytes: int) -> None:
        """Charge a tracked storage's change of size (caller holds the lock)."""
        growth = nbytes - entry.nbytes
        if growth > 0:
            self.reserve(growth)
        entry.nbytes = nbytes
        self.allocated += growth
        if self.allocated > self.peak:
            self.peak = self.allocated

    def _on_free(self, ref: "_StorageRef") -> None:
        # Runs on whichever thread dropped the storage's last reference.
        with self._lock:
            if self._live.get(ref.key) is ref:
                del self._live[ref.key]
                self.allocated -= ref.nbytes
                self.num_frees += 1

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.allocated

    def stats(self) -> dict[str, int]:
        return {
            "allocated_bytes.all.current": self.allocated,
            "allocated_bytes.all.peak": self.peak,
            "num_alloc_retries": 0,
            "num_ooms": self.num_ooms,
            "allocation.all.allocated": self.num_allocs,
            "allocation.all.freed": self.num_frees,
            "allocation.all.current": len(self._live),
            "capacity_bytes": self.capacity,
        }
