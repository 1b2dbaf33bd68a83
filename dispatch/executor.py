"""The Executor interface between dispatch and the engine, and the plain eager executor.

Every ATen op on a neuron tensor reaches `Executor.execute`. The eager executor runs it at
once, as one launch. The adaptive engine (adaptive_eager/) implements the same interface
and decides how ops reach the device; it installs itself with `install_executor`.
"""
from __future__ import annotations

import abc

import torch

from . import transfers
from .classify import classify
from .kernels import run_kernel
from .tensor import NeuronTensor


class Executor(abc.ABC):
    name = "executor"
    # True if factory ops (no tensor input) should reach `execute` too; else their
    # PrivateUse1 kernels run them at once (dispatch/factories.py).
    takes_factories = False

    @abc.abstractmethod
    def execute(self, func, args, kwargs):
        """Run (or schedule) one ATen op whose arguments include neuron tensors."""

    @abc.abstractmethod
    def read(self, t: NeuronTensor) -> torch.Tensor:
        """A fresh host tensor with t's current value: a sync point."""

    def synchronize(self, device_index: int | None) -> None:
        """Run everything held back for the device (None: every device)."""

    def drain(self) -> None:
        """Wait for launches already issued (on the device stream) to finish; launch nothing."""

    @staticmethod
    def decomposed(info, func, args, kwargs):
        """CompositeImplicitAutograd ops reach us whole only when autograd is skipped
        (inference_mode): run what the autograd key would have run. That is our own
        AutogradPrivateUse1 kernel where we registered one (`_neuron_decomposition`: SDPA's
        kernel choice, RMSNorm), else the op's decomposition. NotImplemented if it has none."""
        if info.decomposes:
            own = getattr(func, "_neuron_decomposition", None)
            if own is not None:
                return own(*args, **kwargs)
            return func.decompose(*args, **kwargs)
        return NotImplemented


class EagerExecutor(Executor):
    """Op by op: every op is one launch the moment it is issued."""

    name = "eager"

    def execute(self, func, args, kwargs):
        info = getattr(func, "_neuron_info", None) or classify(func)
        if info.decomposes:
            out = self.decomposed(info, func, args, kwargs)
            if out is not NotImplemented:
                return out
        special = getattr(func, "_neuron_special", None)
        if special is not None:
            return special(info, args, kwargs)
        return run_kernel(info, args, kwargs)

    def read(self, t: NeuronTensor) -> torch.Tensor:
        return transfers.to_host(t)
