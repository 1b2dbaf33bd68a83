"""Registering `neuron` as PyTorch's PrivateUse1 device: once per process, idempotent."""
from __future__ import annotations

import atexit
import os
import threading

import torch

import adaptive_eager.device as neuron_device
from adaptive_eager.device import native, settings
from adaptive_eager.device.torch_module import build_module

from . import (attention, autocast, builtin_kernels, cuda_dtypes, distributed, flash_attention, linear_backward,
               refusal, sharing, sync_batch_norm)
from .context import CONTEXT, install_executor
from .executor import EagerExecutor

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
        settings.check_all()  # every variable, before anything registers: Note [A bad setting fails at first use]
        runtime = neuron_device.get_runtime()
        # The autoload met a bad setting that is fixed now: Note [A bad setting fails at first use].
        refusal.withdraw_refusal()
        torch.utils.rename_privateuse1_backend(BACKEND_NAME)
        torch.utils.generate_methods_for_privateuse1_backend()
        module = build_module(runtime)
        # inductor asks the device module for its code generators, lazily: Note [Inductor on neuron]
        module.__getattr__ = _inductor_attribute
        torch._register_device_module(BACKEND_NAME, module)
        # The guard and hooks in C++, not torch's Python ones: Note [C++ device guard].
        runtime.install()
        # Every op of a neuron tensor runs in C++ (csrc/aten/run_on_host.cpp) unless the engine takes it.
        runtime.install_eager()
        native.add_internal_source_dir(os.path.dirname(os.path.abspath(__file__)) + os.sep)  # Note [Where an op was issued]
        lib = torch.library.Library("aten", "IMPL")
        _libraries.append(lib)
        # The device's own kernels (one launch each way): Note [Custom kernels run whole] in custom_kernels.py.
        attention.register(lib)
        builtin_kernels.register(lib)
        # histc of integers computes CUDA's result: Note [The eager path's kernel, kept] in cuda_dtypes.py.
        cuda_dtypes.register(lib)
        # SyncBatchNorm's kernels, which CPU lacks, compute CUDA's: sync_batch_norm.py.
        sync_batch_norm.register(lib)
        # aten::linear_backward, which TorchNeuron registers and CPU lacks: linear_backward.py.
        linear_backward.register(lib)
        # flash-attn's ops (varlen attention), which CPU lacks, run CPU's flash kernel per sequence.
        flash_attention.register(lib)
        autocast.register(lib)
        # `import torch` has already imported torch.distributed: this costs microseconds.
        distributed.install()
        # A neuron tensor sent to another process is refused, saying what to do instead:
        # Note [Neuron tensors stay in their process] in sharing.py.
        sharing.install()
        if CONTEXT.executor is None:
            install_executor(EagerExecutor())
        runtime.add_sync_hook(_drain_executor)
        # Synchronizing a stream, an event or the device (torch.accelerator.synchronize) in C++
        # runs what the engine holds back first: Note [One queue per device].
        native.set_synchronizer(lambda index: runtime.synchronize(None if index < 0 else index),
                                lambda index: runtime.issue_held(None if index < 0 else index))
        runtime.add_drain_hook(_wait_for_executor)
        # A launch still on the device stream (Note [The device stream]) must not run on while
        # the interpreter exits, nor be in flight when the process forks (the child has no worker).
        atexit.register(_settle_autograd_device_threads)  # atexit runs last-in first: after the wait
        atexit.register(_wait_for_executor)
        os.register_at_fork(before=_settle_before_fork)
        CONTEXT.runtime = runtime  # last: marks registration complete


def _inductor_attribute(name: str):
    from .inductor import lazy_codegen_attribute  # imports nothing of inductor until asked

    return lazy_codegen_attribute(name)


def _drain_executor(device_index):
    CONTEXT.executor.synchronize(device_index)


def _wait_for_executor():
    CONTEXT.executor.drain()


def _settle_before_fork():
    CONTEXT.executor.settle_before_fork()


def _settle_autograd_device_threads():
    """Note [Autograd's device threads at exit]: torch's backward() stashes a Python object
    (a contextvars.Context) in the thread-local state each graph task captures. A device
    thread of C++ autograd drops its graph task just after waking the caller; if the caller
    then exits at once, the drop (a Python decref) asks for the GIL while the interpreter
    finalizes, CPython ends the thread with pthread_exit, and the unwind through a noexcept
    destructor aborts the process ("terminate called without an active exception", after
    the program's last line; seen in CI, and in a core dump: take_gil <- ~ThreadLocalState
    <- ~GraphTask <- Engine::thread_main). A device thread runs its tasks in order and drops
    each before taking the next, so one more graph task on each device, run without the
    stashed object, waits out every earlier drop, and its own needs no GIL."""
    if not native.autograd_device_threads_may_run():
        return
    engine = torch.autograd.Variable._execution_engine
    for index in range(CONTEXT.runtime.device_count):
        x = torch.zeros((), device=torch.device(BACKEND_NAME, index), requires_grad=True)
        y = x * 1.0
        # the C++ engine itself, not backward(): no Python object in this task's state
        engine.run_backward((y,), (torch.ones_like(y),), False, False, (), True, True)
