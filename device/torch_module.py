"""The `torch.neuron` module, modelled on `torch.cuda` and TorchNeuron's module.

Registered by `dispatch` as the PrivateUse1 device module. It speaks only to the runtime.
What of torch.cuda's public names it has, and why it lacks the rest: tests/chip/test_cuda_parity.py.
"""
from __future__ import annotations

import dataclasses
import os
import types

import torch

from .errors import NeuronInvalidDeviceIdError
from .memory import format_bytes
from .profiles import PROFILES
from .runtime import Runtime


@dataclasses.dataclass(frozen=True)
class NeuronDeviceProperties:
    name: str
    profile: str
    total_memory: int
    neuron_cores: int
    hbm_bandwidth_bytes_per_s: float
    dense_bf16_flops: float
    launch_overhead_us: float

    def __repr__(self) -> str:
        return (f"_NeuronDeviceProperties(name='{self.name}', profile='{self.profile}', "
                f"total_memory={self.total_memory // 1024**2}MB, neuron_cores={self.neuron_cores})")


def _named_index(device) -> int | None:
    """The index an int, 'neuron', 'neuron:N' or a torch.device names (None: none, the
    current device), like torch.cuda's device arguments."""
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "neuron":
            raise ValueError(f"Expected a neuron device, but got: {device}")
        return device.index
    if device is None or isinstance(device, int):
        return device
    raise TypeError(f"device must be an int, a str or a torch.device, not {type(device).__name__}")


def _device_index(runtime: Runtime, device) -> int:
    """Accept None, an int, 'neuron', 'neuron:N' or a torch.device, like torch.cuda does."""
    return runtime.check_index(_named_index(device))


def _device_id(runtime: Runtime, device, what: str = "device id") -> int:
    """The index torch.cuda's get_device_properties accepts: None (or a device without an
    index) is the current device; any other index outside [0, device_count()), -1 included,
    raises NeuronInvalidDeviceIdError, an AssertionError as torch.cuda's "Invalid device id"."""
    index = _named_index(device)
    if index is None:
        return runtime.current_index
    if not 0 <= index < runtime.device_count:
        raise NeuronInvalidDeviceIdError(
            f"Invalid {what}: neuron:{index}. It must be in [0, {runtime.device_count}) (None for the current "
            f"device; -1 is not one here, as for torch.cuda.get_device_properties).")
    return index


def _memory(runtime, device):
    """The device's memory accounting, current with no wait: deferred outputs are charged when
    they are issued (Note [Deferred outputs are charged at issue] in csrc/runtime/memory.cpp)."""
    return runtime.devices[_device_index(runtime, device)].memory


def build_module(runtime: Runtime) -> types.ModuleType:
    """A fresh `torch.neuron` module bound to runtime."""
    m = types.ModuleType("torch.neuron", "The emulated AWS Trainium device (adaptive-eager).")

    def is_available() -> bool:
        return True

    def is_initialized() -> bool:
        return True

    def _is_in_bad_fork() -> bool:
        return False

    def _lazy_init() -> None:
        pass

    def device_count() -> int:
        return runtime.device_count

    def current_device() -> int:
        return runtime.current_index

    def set_device(device) -> None:
        runtime.current_index = _device_index(runtime, device)

    class device:
        """Context manager that makes `device` the current neuron device inside the block,
        as torch.cuda.device does (None or -1: a no-op). torch.load and checkpointing use it."""

        def __init__(self, device):
            none = device is None or (isinstance(device, int) and device == -1)
            self.idx = -1 if none else _device_index(runtime, device)
            self.prev_idx = -1

        def __enter__(self):
            if self.idx != -1:
                self.prev_idx = runtime.current_index
                runtime.current_index = self.idx
            return self

        def __exit__(self, *exc) -> bool:
            if self.idx != -1:
                runtime.current_index = self.prev_idx
            return False

    # -- streams and events (Note [One queue per device] in csrc/runtime/streams.cpp) -------------
    # Functions returning torch.Stream / torch.Event, not subclasses: torch's own methods
    # (elapsed_time, wait_event, ...) accept only exact torch.Event / torch.Stream objects.
    def Stream(device=None, priority=0) -> torch.Stream:  # noqa: N802 (torch.cuda.Stream's name)
        """A new neuron stream, as torch.cuda.Stream(). Every stream of a device names the
        device's one in-order queue, so work on two streams never overlaps: `wait_stream`
        and `wait_event` have nothing to wait for, and the modelled time is the same."""
        return torch.Stream(device=torch.device("neuron", _device_index(runtime, device)), priority=priority)

    def Event(enable_timing=False, blocking=False, interprocess=False) -> torch.Event:  # noqa: N802
        """A neuron event, as torch.cuda.Event(). With enable_timing=True, `elapsed_time` is
        the modelled device time between the two records, in milliseconds."""
        return torch.Event(device="neuron", enable_timing=enable_timing, blocking=blocking,
                           interprocess=interprocess)

    def current_stream(device=None) -> torch.Stream:
        return torch.accelerator.current_stream(_device_index(runtime, device))

    def default_stream(device=None) -> torch.Stream:
        current = current_stream(device)
        return torch.Stream(stream_id=0, device_index=current.device_index, device_type=current.device_type)

    def set_stream(stream) -> None:
        if stream is not None:
            torch.accelerator.set_stream(stream)

    class StreamContext:
        """`with torch.neuron.stream(s):` runs the block with s as the current stream (and its
        device as the current device), as torch.cuda.stream does; None: a no-op."""

        def __init__(self, stream):
            self.stream = stream
            self.prev_stream = self.prev_device = None

        def __enter__(self):
            if self.stream is None:
                return self.stream
            self.prev_device = runtime.current_index
            self.prev_stream = torch.accelerator.current_stream(self.stream.device_index)
            torch.accelerator.set_stream(self.stream)
            return self.stream

        def __exit__(self, *exc) -> bool:
            if self.stream is not None:
                torch.accelerator.set_stream(self.prev_stream)
                runtime.current_index = self.prev_device
            return False

    def stream(stream) -> StreamContext:
        return StreamContext(stream)

    class device_of(device):  # noqa: N801 (torch.cuda.device_of's name)
        """Context manager that makes the device of `obj` (a tensor or storage) current, as
        torch.cuda.device_of; a no-op for an object that is not on neuron."""

        def __init__(self, obj):
            super().__init__(obj.get_device() if obj.device.type == "neuron" else -1)

    def init() -> None:
        """The device is ready once registered (is_initialized() is True): nothing to do."""

    def is_current_stream_capturing() -> bool:
        """No graph capture exists on neuron (the adaptive engine captures repeating op
        sequences by itself), so never."""
        return False

    def can_device_access_peer(device, peer_device) -> bool:
        """Whether device can read peer_device's memory directly: every pair of distinct
        neuron devices can (one host memory; NeuronLink between a chip's cores), none with itself."""
        return _device_id(runtime, device) != _device_id(runtime, peer_device, "peer device id")

    def get_arch_list() -> list[str]:
        """The device profiles this emulator models (NEURON_PROFILE picks one)."""
        return sorted(PROFILES)

    def synchronize(device=None) -> None:
        """Wait for all work queued on the device. Every device is drained: with one
        in-order host thread feeding all devices, that is never wrong and never slower."""
        if device is not None:
            _device_index(runtime, device)
        runtime.synchronize(None)

    # -- random numbers ----------------------------------------------------------------
    # Note [Random ops draw from CPU's generator] (csrc/runtime/generator.cpp): random ops on
    # neuron draw from torch's default CPU generator, a deferred one at issue, as TorchNeuron's
    # do; a device's own generator is a seed and an offset (16 bytes) that no op draws from. So
    # nothing here waits for the device.
    def manual_seed(seed: int) -> None:
        runtime.device().manual_seed(seed)

    def manual_seed_all(seed: int) -> None:
        # Called by torch.manual_seed; must not call back into torch.manual_seed.
        for d in runtime.devices:
            d.manual_seed(seed)

    def seed() -> None:
        manual_seed(int.from_bytes(os.urandom(8), "little"))

    def seed_all() -> None:
        manual_seed_all(int.from_bytes(os.urandom(8), "little"))

    def initial_seed() -> int:
        return runtime.device().initial_seed

    def get_rng_state(device="neuron") -> torch.Tensor:
        return runtime.devices[_device_index(runtime, device)].generator.get_state()

    def get_rng_state_all() -> list[torch.Tensor]:
        return [d.generator.get_state() for d in runtime.devices]

    def set_rng_state(new_state: torch.Tensor, device="neuron") -> None:
        if not isinstance(new_state, torch.Tensor) or new_state.dtype != torch.uint8:
            raise TypeError("set_rng_state expects the torch.uint8 tensor returned by get_rng_state")
        runtime.devices[_device_index(runtime, device)].generator.set_state(new_state.cpu())

    def set_rng_state_all(new_states) -> None:
        for i, s in enumerate(new_states):
            set_rng_state(s, i)

    # -- memory ------------------------------------------------------------------------
    def memory_allocated(device=None) -> int:
        return _memory(runtime, device).allocated

    def max_memory_allocated(device=None) -> int:
        return _memory(runtime, device).peak

    def memory_reserved(device=None) -> int:
        return memory_allocated(device)

    def max_memory_reserved(device=None) -> int:
        return max_memory_allocated(device)

    def reset_peak_memory_stats(device=None) -> None:
        _memory(runtime, device).reset_peak()

    def memory_stats(device=None) -> dict:
        """CUDA's keys ("allocated_bytes.all.current", ...) and TorchNeuron's beside them
        ("allocated_bytes": {"current", "peak", "allocated", "freed"}, "allocation_requests",
        ...): code written for either reads its own (device/memory.py)."""
        return _memory(runtime, device).stats()

    def mem_get_info(device=None) -> tuple[int, int]:
        mem = _memory(runtime, device)
        return mem.capacity - mem.allocated, mem.capacity

    def memory_summary(device=None, abbreviated: bool = False) -> str:
        """One line of the device's memory; unless abbreviated (torch.cuda's and TorchNeuron's
        argument), a table after it of the figures TorchNeuron's summary shows."""
        mem = _memory(runtime, device)
        line = (f"{mem.device_name}: allocated {format_bytes(mem.allocated)}, "
                f"peak {format_bytes(mem.peak)}, capacity {format_bytes(mem.capacity)}")
        return line if abbreviated else line + "\n" + mem.summary_table()

    def empty_cache() -> None:
        """Nothing to release: the emulated allocator keeps no cache."""

    def set_per_process_memory_fraction(fraction: float, device=None) -> None:
        """Cap what this process may allocate on the device at fraction * its capacity: an
        allocation beyond it raises torch.OutOfMemoryError, as on CUDA."""
        if not isinstance(fraction, (int, float)) or isinstance(fraction, bool):
            raise TypeError(f"Invalid type for fraction argument, must be `float`, not {type(fraction).__name__}")
        _memory(runtime, device).set_fraction(fraction)

    def get_per_process_memory_fraction(device=None) -> float:
        mem = _memory(runtime, device)
        return mem.limit / mem.capacity

    def reset_max_memory_allocated(device=None) -> None:
        reset_peak_memory_stats(device)

    def reset_accumulated_memory_stats(device=None) -> None:
        torch.accelerator.reset_accumulated_memory_stats(_device_index(runtime, device))

    def memory_stats_as_nested_dict(device=None) -> dict:
        """memory_stats() with its dotted keys as nested dicts, as torch.cuda's."""
        nested: dict = {}
        for key, value in memory_stats(device).items():
            if isinstance(value, dict):
                continue  # TorchNeuron's keys, nested already: the same figures as CUDA's
            *path, last = key.split(".")
            node = nested
            for part in path:
                node = node.setdefault(part, {})
            node[last] = value
        return nested

    # torch.cuda's deprecated names for the reserved figures (no cache: reserved == allocated).
    def memory_cached(device=None) -> int:
        return memory_reserved(device)

    def max_memory_cached(device=None) -> int:
        return max_memory_reserved(device)

    def reset_max_memory_cached(device=None) -> None:
        reset_peak_memory_stats(device)

    def device_memory_used(device=None) -> int:
        """Device memory in use, as the device's own tools would report it: what is allocated."""
        return memory_allocated(device)

    # -- properties --------------------------------------------------------------------
    def get_device_properties(device=None) -> NeuronDeviceProperties:
        index = _device_id(runtime, device)
        cfg = runtime.config
        share = cfg.logical_cores / cfg.profile.neuron_cores_per_chip
        return NeuronDeviceProperties(
            name=get_device_name(index), profile=cfg.profile.name,
            total_memory=runtime.devices[index].memory.capacity, neuron_cores=cfg.logical_cores,
            hbm_bandwidth_bytes_per_s=cfg.profile.hbm_bandwidth_bytes_per_s * share,
            dense_bf16_flops=cfg.profile.dense_bf16_flops * share,
            launch_overhead_us=cfg.launch_overhead_us)

    def get_device_name(device=None) -> str:
        _device_id(runtime, device)
        cfg = runtime.config
        return f"AWS Trainium {cfg.profile.name} (emulated, {cfg.logical_cores} NeuronCores)"

    def get_device_capability(device=None) -> tuple[int, int]:
        _device_id(runtime, device)
        return (int(runtime.config.profile.name[-1]), 0)

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        return True

    def get_amp_supported_dtype() -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    for fn in list(locals().values()):
        if callable(fn) and getattr(fn, "__module__", None) == __name__ and fn is not build_module:
            fn.__module__ = "torch.neuron"
            setattr(m, fn.__name__, fn)
    m.NeuronDeviceProperties = NeuronDeviceProperties
    m.OutOfMemoryError = torch.OutOfMemoryError  # what the allocator raises, as torch.cuda's
    m.AcceleratorError = torch.AcceleratorError
    # torch.cuda's flag, read by torch.utils.checkpoint: it saves and restores the device's RNG
    # state around a recomputed forward only when the device module says it is initialized
    # (else dropout draws a new mask in backward). The device is ready once registered.
    m._initialized = True
    return m
