"""Registering `neuron` as PyTorch's PrivateUse1 device: once per process, idempotent."""
from __future__ import annotations

import atexit
import os
import threading

import torch

import device as neuron_device
from device import native
from device.torch_module import build_module

from . import attention, autocast, builtin_kernels, distributed, host_compat, optim_compat, transfers
from .context import CONTEXT, install_executor
from .executor import EagerExecutor
from .factories import register_factories
from .tensor import NEURON_DEVICES

SUPPORTED_TORCH = ((2, 13),)
BACKEND_NAME = "neuron"
_lock = threading.Lock()
_libraries: list[torch.library.Library] = []


def check_torch_version(version: str = torch.__version__) -> None:
    major, minor = (int(p) for p in version.split("+")[0].split(".")[:2])
    if (major, minor) not in SUPPORTED_TORCH:
        supported = ", ".join(f"{a}.{b}" for a, b in SUPPORTED_TORCH)
        raise ImportError(
            f"adaptive-eager supports torch {supported} (its PrivateUse1 backend, C++ core included, "
            f"uses APIs that change between releases), but torch {version} is installed. "
            f"Install a supported release: pip install 'torch>=2.13,<2.14'.")


def is_registered() -> bool:
    return CONTEXT.runtime is not None


def register() -> None:
    """Make `neuron` a PyTorch device. Safe to call any number of times."""
    with _lock:
        if is_registered():
            return
        check_torch_version()
        current = torch._C._get_privateuse1_backend_name()
        if current not in ("privateuseone", BACKEND_NAME):
            raise RuntimeError(
                f"PrivateUse1 is already registered as {current!r} in this process, so adaptive-eager cannot "
                f"register 'neuron'. Only one PrivateUse1 backend can be loaded per process; "
                f"disable the other one (or set TORCH_DEVICE_BACKEND_AUTOLOAD=0 and import one explicitly).")
        runtime = neuron_device.get_runtime()
        torch.utils.rename_privateuse1_backend(BACKEND_NAME)
        torch.utils.generate_methods_for_privateuse1_backend()
        torch._register_device_module(BACKEND_NAME, build_module(runtime))
        # The guard and hooks in C++, not torch's Python ones: Note [C++ device guard].
        runtime.install()
        NEURON_DEVICES[:] = [torch.device(BACKEND_NAME, i) for i in range(runtime.device_count)]
        lib = torch.library.Library("aten", "IMPL")
        _libraries.append(lib)
        if runtime.config.native_tensors:
            # Real PrivateUse1 tensors: every op runs in C++ (csrc/eager.cpp), eager mode only.
            runtime.install_eager()
        else:
            register_factories(lib)
            transfers.register_copy_kernels(lib)
        # The device's own kernels (one launch each way), on either kind of tensor: Note
        # [Custom kernels on native tensors] in custom_kernels.py.
        attention.register(lib, native_tensors=runtime.config.native_tensors)
        builtin_kernels.register(lib, native_tensors=runtime.config.native_tensors)
        autocast.register(lib)
        host_compat.install(runtime, native_tensors=runtime.config.native_tensors)
        optim_compat.install()
        # `import torch` has already imported torch.distributed: this costs microseconds.
        distributed.install()
        CONTEXT.ops = [0] * runtime.device_count
        if CONTEXT.executor is None:
            install_executor(EagerExecutor())
        runtime.add_sync_hook(_drain_executor)
        # Synchronizing a stream, an event or the device (torch.accelerator.synchronize) in C++
        # runs what the engine holds back first: Note [One queue per device].
        native.set_synchronizer(lambda index: runtime.synchronize(None if index < 0 else index))
        runtime.add_drain_hook(_wait_for_executor)
        # A launch still on the device stream (device/stream.py) must not run on while the
        # interpreter exits, nor be in flight when the process forks (the child has no worker).
        atexit.register(_wait_for_executor)
        os.register_at_fork(before=_wait_for_executor)
        CONTEXT.runtime = runtime  # last: marks registration complete


def _drain_executor(device_index):
    CONTEXT.executor.synchronize(device_index)


def _wait_for_executor():
    CONTEXT.executor.drain()
