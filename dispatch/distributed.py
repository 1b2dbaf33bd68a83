"""torch.distributed on `neuron`: the "neuron" process-group backend and the collective kernel.

Note [Collectives]: on TorchNeuron, `init_process_group(backend="neuron")` gives a group
whose collectives run on the device. Ours runs them on each tensor's host data through
gloo, the way every op of the emulated device runs on its host data:

- The backend. `Backend.register_backend("neuron", ...)` with a creator that returns a
  whole `ProcessGroup` holding one gloo backend for both `cpu` and `neuron`. A creator
  that returned a bare gloo backend would be registered for `neuron` only when
  `init_process_group()` is called without a backend (torch then maps just the
  accelerator), and a neuron collective unwraps to CPU tensors, which then found no
  backend. Registering "neuron" for the `neuron` device also makes it the default backend
  once neuron is the accelerator (before, `init_process_group()` raised "we don't know
  which communication backend to use").
- The kernel. `c10d.*` ops on neuron tensors take the C++ eager path like any op: gloo runs
  on host aliases of the device's bytes and writes into them. Their OpInfo says
  `is_collective` (classify.py): the adaptive engine treats them as sync points (every
  pending op runs first).
- Async work: `async_op=True` returns gloo's Work; gloo may still be writing the host data
  until `.wait()`, exactly as a CPU tensor would be. A collective is never part of a fused
  trace: replaying it later would change when it meets the other ranks.
"""
from __future__ import annotations

import datetime

import torch

BACKEND_NAME = "neuron"
DEVICES = ("neuron", "cpu")


# -- the process-group backend ---------------------------------------------------------------
def create_process_group(store, rank: int, world_size: int, timeout: datetime.timedelta):
    """The "neuron" backend's creator: one gloo backend serving both CPU and neuron tensors
    (neuron collectives run on the host data, see Note [Collectives])."""
    from torch.distributed import ProcessGroup, ProcessGroupGloo

    gloo = ProcessGroupGloo(store, rank, world_size, timeout)
    gloo._set_sequence_number_for_group()  # what torch does for its own gloo groups
    group = ProcessGroup(store, rank, world_size)
    group._set_default_backend(ProcessGroup.BackendType.GLOO)
    for device in DEVICES:
        group._register_backend(torch.device(device), ProcessGroup.BackendType.GLOO, gloo)
    return group


def install() -> bool:
    """Register the "neuron" c10d backend and DDP's option checks (idempotent). False if this
    torch build has no torch.distributed or no gloo: `backend="neuron"` then stays unknown."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        return False
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, create_process_group, devices=list(DEVICES))
    return True
