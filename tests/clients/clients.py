"""Shared by the real-client tests: importing a client, and running one training loop three
ways (CPU, neuron eager, neuron adaptive) with the results to compare.

The clients are extras (`pip install -e ".[clients]"`). Without them their tests skip, saying
so; CI installs them and sets ADAPTIVE_EAGER_REQUIRE_CLIENTS=1, so that a client which stops
installing or importing fails there instead of skipping silently.
"""
from __future__ import annotations

import dataclasses
import importlib
import os

import pytest
import torch

import adaptive_eager


def require(module: str, extra: str = "clients", then: str = ""):
    """The client module, or a skip naming the extra and any further step `then` (a failure
    when CI requires clients)."""
    if os.environ.get("ADAPTIVE_EAGER_REQUIRE_CLIENTS") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"{module} is a real-client extra: pip install -e \".[{extra}]\"{then} "
                                              "(README: Serving with vLLM, for the vllm extra)")


@dataclasses.dataclass
class Run:
    losses: list[float]
    state: dict  # every parameter and buffer, on the host
    launches: list[int]  # per step


def host_state(model: torch.nn.Module) -> dict:
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def train(device: str, mode: str, make_model, make_batch, steps: int, *, dropout_seed=None) -> Run:
    """AdamW steps of make_model() on device in mode; make_batch(generator) -> forward kwargs on
    the host. loss.item() every step, as training loops log it."""
    with adaptive_eager.mode(mode):
        torch.manual_seed(0)
        model = make_model().to(device).train()
        if dropout_seed is not None:
            # The dropout masks from here: CPU's generator on cpu, the device's on neuron, seeded
            # alike (on neuron, model init drew from CPU's generator, not the device's).
            torch.manual_seed(dropout_seed)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        losses, launches = [], []
        for _ in range(steps):
            batch = {k: v.to(device) for k, v in make_batch(g).items()}
            before = adaptive_eager.stats().launches
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            launches.append(adaptive_eager.stats().launches - before)
        return Run(losses, host_state(model), launches)


def assert_bitwise(cpu: Run, neuron: Run) -> None:
    assert neuron.losses == cpu.losses
    assert neuron.state.keys() == cpu.state.keys()
    differ = [k for k in cpu.state if not torch.equal(cpu.state[k], neuron.state[k])]
    assert not differ, f"{len(differ)} of {len(cpu.state)} tensors differ from CPU's, first {differ[:3]}"
    assert len(set(cpu.losses)) > 1, "the loss never moved: comparing it proves nothing"
