"""torchtitan's llama3 debug model trains on neuron with varlen attention (issue 39, item 2;
issue 37, item 7). torchtitan 0.3.0's llama3 allows flex or varlen attention only; varlen
calls flash-attn's ops (`torch.nn.attention.varlen.varlen_attn`), which have no CPU kernel: on
neuron it raised "aten::_flash_attention_forward has no CPU kernel".

CPU cannot run varlen attention at all, so the CPU reference runs the same model with neuron's
kernels for flash-attn's ops registered for CPU for the duration of the run: each sequence
through CPU's flash kernel, which test_ops_cpu_lacks.py checks against CPU's SDPA on each
sequence alone, bit for bit. Everything else in the model is CPU's own.

torchtitan asks for a torch nightly; it is installed without its dependencies (pinned, with
the two modules its model code imports), as the `titan` list of pyproject.toml says.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import adaptive_eager
from clients import require

require("torchtitan.models.llama3", extra="titan", then=", then pip install --no-deps torchtitan==0.3.0")
from torchtitan.models.llama3 import model_registry  # noqa: E402

STEPS = 6
SEQ, DOCUMENTS = 32, (12, 20)  # each row packs two documents: positions restart at 0


@contextlib.contextmanager
def _cpu_runs_flash_attention_per_sequence():
    from adaptive_eager.dispatch import flash_attention

    lib = torch.library.Library("aten", "IMPL")
    try:
        lib.impl("_flash_attention_forward", flash_attention.flash_attention_forward, "CPU")
        lib.impl("_flash_attention_backward", flash_attention.flash_attention_backward, "CPU")
        yield
    finally:
        lib._destroy()


def _train(device: str, mode: str = "adaptive"):
    spec = model_registry("debugmodel", attn_backend="varlen")
    with adaptive_eager.mode(mode):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = spec.model.build()
        model.to_empty(device=device)
        with torch.no_grad():
            model.init_states(buffer_device=torch.device(device))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        positions = torch.cat([torch.arange(n) for n in DOCUMENTS]).repeat(2, 1)
        losses, launches = [], []
        for _ in range(STEPS):
            tokens, labels = torch.randint(0, 2048, (2, SEQ), generator=g), torch.randint(0, 2048, (2, SEQ), generator=g)
            before = adaptive_eager.stats().launches
            pos = positions.to(device)
            out = model(tokens.to(device), pos, model.get_attention_masks(pos))
            loss = torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), labels.to(device).flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            launches.append(adaptive_eager.stats().launches - before)
        return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}, launches


@pytest.fixture(scope="module")
def cpu_run():
    with _cpu_runs_flash_attention_per_sequence():
        return _train("cpu")


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
def test_torchtitans_llama3_with_varlen_attention_trains_on_neuron_with_cpus_bits(cpu_run, mode):
    losses, state, launches = _train("neuron", mode)
    cpu_losses, cpu_state, _ = cpu_run
    assert losses == cpu_losses and len(set(losses)) > 1
    differ = [k for k in cpu_state if not torch.equal(cpu_state[k], state[k])]
    assert not differ, f"{len(differ)} of {len(cpu_state)} tensors differ from CPU's, first {differ[:3]}"
    if mode == "adaptive":
        # The step's own host reads (torchtitan's nonzero and .item() finding the documents,
        # the offsets read once for all layers, loss.item()) each launch what precedes them.
        assert max(launches[-2:]) <= 8, launches


def test_without_neurons_kernels_cpu_cannot_run_varlen_attention():
    """The reference above needs the registration: CPU on its own refuses (what neuron did)."""
    with pytest.raises(NotImplementedError, match="_flash_attention_forward"):
        _train("cpu")


@pytest.mark.parametrize("mode", ["adaptive"])
def test_torchtitans_llama3_trains_with_fsdp2_on_two_neuron_ranks_with_two_cpu_ranks_bits(tmp_path, mode):
    """2-rank FSDP2 under torchrun (tests/fsdp_worker.py, 'titan'): each transformer block
    sharded as torchtitan shards it, five AdamW steps, against the same run on two CPU ranks
    (gloo), whose varlen attention runs neuron's per-sequence kernels. (No DCP resume here:
    torchtitan's fused q/k/v weights need its own checkpoint wrapper.)"""
    import json
    import pathlib

    from torchrun import finish, torchrun

    worker = pathlib.Path(__file__).parent.parent / "fsdp_worker.py"
    runs = {"neuron": ("neuron", {"NEURON_ADAPTIVE_EAGER": "1" if mode == "adaptive" else "0"}),
            "cpu": ("cpu", {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})}
    jobs = {}
    for name, (device, env) in runs.items():
        (tmp_path / name).mkdir()
        jobs[name] = torchrun(str(worker), str(tmp_path / name), device, "fsdp2", "titan", env=env)
    for job in jobs.values():
        finish(job)
    ranks = {name: [json.loads((tmp_path / name / f"rank{r}.json").read_text()) for r in range(2)] for name in runs}
    for neuron, cpu in zip(ranks["neuron"], ranks["cpu"]):
        assert neuron["device"].startswith("neuron") and cpu["device"] == "cpu"
        assert neuron["losses"] == cpu["losses"] and len(set(cpu["losses"])) > 1
        assert neuron["params"] == cpu["params"]
