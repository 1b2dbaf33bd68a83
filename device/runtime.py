"""The emulated chip's runtime: devices, the in-order launch queue, transfers, the clock.

Every kernel reaches a device through `Runtime.launch`; every copy across the host/device
boundary (or between devices) through `Runtime.transfer`. Launches are accounted in issue
order; they run on the calling thread, or (fused launches of the adaptive engine) on the
device stream's worker thread (stream.py), which is in order too, so the device clock is
the sum of what the cost model charges. Upper layers that hold work back (the adaptive
engine) register a sync hook, which `synchronize` calls to run it, and a drain hook, which
`drain` calls to wait for launches on the stream.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Callable

import torch

from . import native, settings
from .config import DeviceConfig
from .cost import CostModel
from .errors import NeuronDeviceIndexError
from .memory import DeviceMemory
from .profiling import mark_device_time, profiler_enabled

# The dtypes the C++ eager path prices at their own rate; others at float32's.
_PRICED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                  torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)

# CUDA's default seed, so an unseeded run is reproducible the same way.
DEFAULT_SEED = 67280421310721


@dataclasses.dataclass
class Counters:
    """What one device has done since the last reset: a snapshot of the C++ clock's counters."""

    launches: int = 0
    kernel_ops: int = 0  # ops executed inside launches (a fused launch holds many)
    transfers: int = 0
    transfer_bytes: int = 0
    device_time_us: float = 0.0
    launch_overhead_us: float = 0.0  # the part of device_time_us spent on launch overhead


class NeuronDevice:
    """One logical device `neuron:N`: memory, generator, counters."""

    def __init__(self, index: int, config: DeviceConfig):
        self.index = index
        self.name = f"neuron:{index}"
        self.memory = DeviceMemory(index, config.capacity_bytes)

    @property
    def generator(self) -> torch.Generator:
        """The device's default generator: a seed and an offset, as TorchNeuron's; random ops
        draw from torch's default CPU generator (Note [Random ops draw from CPU's generator] in
        csrc/runtime/generator.cpp)."""
        return native.default_generator(self.index)

    @property
    def initial_seed(self) -> int:
        return self.generator.initial_seed()

    @property
    def counters(self) -> Counters:
        return Counters(*native.counters(self.index))

    def manual_seed(self, seed: int) -> None:
        self.generator.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)


class Runtime:
    def __init__(self, config: DeviceConfig | None = None):
        self.config = config or DeviceConfig.from_env()
        self.cost = CostModel(self.config)
        self.devices = [NeuronDevice(i, self.config) for i in range(self.config.num_devices)]
        self._sync_hooks: list[Callable[[int | None], None]] = []
        self._drain_hooks: list[Callable[[], None]] = []

    # -- devices -------------------------------------------------------------------------
    @property
    def device_count(self) -> int:
        return len(self.devices)

    @property
    def current_index(self) -> int:
        """The calling thread's current device (per thread, as on CUDA): the C++ guard's,
        so torch.neuron, torch.accelerator and C++ autograd agree (Note [C++ device guard])."""
        return native.current_device()

    @current_index.setter
    def current_index(self, index: int) -> None:
        native.set_current_device(self.check_index(index))

    def check_index(self, index: int | None) -> int:
        """The device index to use for `index` (None = current); raises on a bad index."""
        if index is None or index == -1:
            return self.current_index
        if not 0 <= index < len(self.devices):
            raise NeuronDeviceIndexError(
                f"Invalid device: neuron:{index}. The device index is out of range; it must be in "
                f"[0, {len(self.devices)}) on this {self.config.profile.name} configuration "
                f"(set NEURON_NUM_DEVICES or NEURON_LOGICAL_NC_CONFIG for more devices).")
        return index

    def device(self, index: int | None = None) -> NeuronDevice:
        return self.devices[self.check_index(index)]

    # -- launches and transfers ----------------------------------------------------------
    def launch(self, index: int, op_costs_us: float, num_ops: int = 1, name: str = "kernel") -> float:
        """Account one kernel launch holding num_ops ops whose roofline time is op_costs_us
        (name: the kernel's, on the profiler's device timeline). Returns the launch's emulated
        device time."""
        overhead = self.cost.launch_overhead_us
        total = native.account_launch(index, overhead, op_costs_us, num_ops, name)
        if self.config.spend_launch_overhead and overhead:
            _spin_us(overhead)
        return total

    def transfer(self, index: int, nbytes: int) -> float:
        """Account one copy between the host and device `index` (or between devices)."""
        us = self.cost.transfer_us(nbytes)
        native.transfer(index, nbytes, us)
        if profiler_enabled():  # inside the caller's transfer range: Note [Profiler ranges]
            mark_device_time(us, bytes=nbytes, device=index)
        return us

    def refund(self, index: int, op_costs_us: float, num_ops: int) -> None:
        """A launch accounted when it was issued failed before num_ops of its ops ran."""
        native.refund(index, op_costs_us, num_ops)

    # -- synchronization -----------------------------------------------------------------
    def add_sync_hook(self, hook: Callable[[int | None], None]) -> None:
        """hook(index or None) runs all work held back for that device (None = all)."""
        if hook not in self._sync_hooks:
            self._sync_hooks.append(hook)

    def remove_sync_hook(self, hook) -> None:
        if hook in self._sync_hooks:
            self._sync_hooks.remove(hook)

    def add_drain_hook(self, hook: Callable[[], None]) -> None:
        """hook() waits for launches already issued to finish (and their host-side accounting
        to be done), without launching anything held back: for readers of device state."""
        if hook not in self._drain_hooks:
            self._drain_hooks.append(hook)

    def drain(self) -> None:
        for hook in list(self._drain_hooks):
            hook()
        native.wait_for_device()  # the eager ops posted to the device (Note [The device executor])

    def synchronize(self, index: int | None = None) -> None:
        self.issue_held(index)
        native.wait_for_device()

    def issue_held(self, index: int | None = None) -> None:
        """Issue what upper layers hold back (the sync hooks) without waiting for it to run:
        a timing event's record (Note [One queue per device] in runtime/streams.cpp)."""
        if index is not None:
            self.check_index(index)
        for hook in list(self._sync_hooks):
            hook(index)

    def set_spend_launch_overhead(self, spend: bool) -> bool:
        """Spend (True) or only model (False) the launch overhead from now on; returns the
        previous setting. NEURON_SPEND_LAUNCH_OVERHEAD sets the initial value."""
        previous = self.config.spend_launch_overhead
        # The config is frozen (shared with the cost model); replace it rather than mutate.
        # Only this flag changes, so the cost model built from the old config stays valid.
        self.config = dataclasses.replace(self.config, spend_launch_overhead=bool(spend))
        native.set_spend_overhead(bool(spend))
        return previous

    def reset_counters(self) -> None:
        native.reset_counters()
        for d in self.devices:
            d.memory.reset_peak()

    def install(self) -> None:
        """Give the C++ core this runtime's devices: guard, hooks, allocator, clock. Once per
        process, at registration (Note [C++ device guard])."""
        native.install(self.device_count, [d.memory.capacity for d in self.devices],
                       self.cost.launch_overhead_us, self.config.spend_launch_overhead, DEFAULT_SEED)

    def install_eager(self) -> None:
        """Register the C++ eager path (csrc/aten/registration.cpp), with this runtime's cost figures.
        Once per process, after install()."""
        flop_us = {dt: self.cost.us_per_flop(dt) for dt in _PRICED_DTYPES}
        element_us = {dt: self.cost.us_per_vector_element(dt) for dt in _PRICED_DTYPES}
        converted = {dt: why for dt in _PRICED_DTYPES if (why := self.config.profile.converted(dt))}
        native.set_launch_blocking(bool(settings.read("NEURON_LAUNCH_BLOCKING")))  # Note [Eager ops run on the device]
        native.set_executor_spin(settings.read("NEURON_EXECUTOR_SPIN_US"))  # Note [The executor spins before it sleeps]
        native.set_device_team_sleeps(settings.read("NEURON_DEVICE_TEAM_SLEEPS"))  # Note [The device's team sleeps between regions]
        # A posted op's error names the user's line, not torch's nor ours: Note [Where an op was issued].
        for package in (torch, sys.modules[__package__]):
            native.add_internal_source_dir(os.path.dirname(os.path.abspath(package.__file__)) + os.sep)
        native.install_eager(self.cost.us_per_byte, self.cost.on_chip_bytes, flop_us, self.cost.us_per_flop(torch.float32),
                             element_us, self.cost.us_per_vector_element(torch.float32), converted)
        native.set_collective_costs(**self.cost.collective_costs())


def _spin_us(us: float) -> None:
    # time.sleep cannot wait 15 us; spinning is what a host blocked on a launch does anyway.
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass
