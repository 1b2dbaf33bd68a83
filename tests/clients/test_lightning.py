"""PyTorch Lightning on neuron (issue 39, item 1): `Trainer(accelerator="neuron", devices=N)`,
registered with Lightning's accelerator registry when Lightning is imported
(adaptive_eager/lightning_plugin). Before, Lightning refused the name; a hand-made accelerator
got a CPU root device.

Each run is compared with the same Trainer on CPU: the losses and every parameter bitwise, one
device in process, two devices (DDP, Lightning's own launcher re-running the script) against
two CPU ranks.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import adaptive_eager
from clients import require

pl = require("lightning.pytorch")

STEPS = 16  # 2 epochs of 8 batches
STEADY = 6  # the last steps of the second epoch


def _module_class(lightning):
    class Regressor(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
            self.losses, self.launches = [], []

        def training_step(self, batch, index):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.detach())
            return loss

        def on_train_batch_start(self, *args):
            self._before = adaptive_eager.stats().launches

        def on_train_batch_end(self, *args):
            self.launches.append(adaptive_eager.stats().launches - self._before)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return Regressor


def _loader():
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=8)


def _fit(accelerator, mode="adaptive", **trainer_kwargs):
    model = _module_class(pl)()
    trainer = pl.Trainer(accelerator=accelerator, max_epochs=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs)
    with adaptive_eager.mode(mode):
        trainer.fit(model, _loader())
    return trainer, model


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
def test_trainer_on_neuron_by_name_trains_on_the_device_with_cpus_bits(mode):
    _, cpu = _fit("cpu", devices=1)
    trainer, neuron = _fit("neuron", mode, devices=1)
    assert trainer.strategy.root_device == torch.device("neuron", 0)
    assert type(trainer.accelerator).__name__ == "NeuronAccelerator"
    assert [l.item() for l in neuron.losses] == [l.item() for l in cpu.losses]
    assert len(neuron.losses) == STEPS and len({l.item() for l in cpu.losses}) > 1
    assert all(torch.equal(a.cpu(), b) for a, b in zip(neuron.state_dict().values(), cpu.state_dict().values()))
    assert min(neuron.launches) > 0  # the steps ran on the device
    if mode == "adaptive":
        assert max(neuron.launches[-STEADY:]) <= 1, neuron.launches


def test_the_devices_flag_is_checked_against_the_emulated_device_count():
    count = torch.neuron.device_count()
    with pytest.raises(ValueError, match=rf"asks for {count + 1} devices, but {count} are emulated.*NEURON_DEVICE_COUNT"):
        pl.Trainer(accelerator="neuron", devices=count + 1)
    with pytest.raises(ValueError, match=r"indices must be distinct and in \[0, "):
        pl.Trainer(accelerator="neuron", devices=[count])


def test_a_strategy_for_another_device_is_refused_naming_what_to_pass():
    trainer = pl.Trainer(accelerator="neuron", strategy=pl.strategies.SingleDeviceStrategy(device="cpu"),
                         max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match=r"root device cpu.*SingleDeviceStrategy\(device='neuron:0'\)"):
        trainer.fit(_module_class(pl)(), _loader())


_IMPORT_ORDERS = {
    "lightning before torch": "import lightning.pytorch as pl\nimport torch",
    "torch before lightning": "import torch\nimport lightning.pytorch as pl",
    "the standalone pytorch_lightning": "import pytorch_lightning as pl\nimport torch",
}


@pytest.mark.parametrize("imports", _IMPORT_ORDERS.values(), ids=_IMPORT_ORDERS.keys())
def test_neuron_is_in_lightnings_registry_whatever_is_imported_first(imports):
    """torch's backend autoload imports adaptive_eager inside whichever import comes first; the
    registration waits for Lightning's registry in both orders, and in both Lightning packages."""
    code = imports + textwrap.dedent("""
        print("neuron" in pl.accelerators.AcceleratorRegistry)
        t = pl.Trainer(accelerator="neuron", devices=1, logger=False)
        print(t.strategy.root_device)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "neuron:0"]


_DDP_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    import torch
    import lightning.pytorch as pl
    from test_lightning import _loader, _module_class
    accelerator, out = sys.argv[1], sys.argv[2]
    model = _module_class(pl)()
    trainer = pl.Trainer(accelerator=accelerator, devices=2, max_epochs=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, _loader())
    result = {{"strategy": type(trainer.strategy).__name__, "root": str(trainer.strategy.root_device),
              "backend": trainer.strategy._process_group_backend, "launches": model.launches,
              "state": {{k: v.cpu().tolist() for k, v in model.state_dict().items()}}}}
    with open(f"{{out}}.{{trainer.global_rank}}.json", "w") as f:
        json.dump(result, f)
""")


def _run_ddp(tmp_path, accelerator: str) -> list[dict]:
    script = tmp_path / "fit_two_devices.py"
    script.write_text(_DDP_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / accelerator
    env = {**os.environ, "NEURON_ADAPTIVE_EAGER": "1"}  # adaptive mode in both ranks
    run = subprocess.run([sys.executable, str(script), accelerator, str(out)], capture_output=True, text=True,
                         timeout=600, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads((tmp_path / f"{accelerator}.{rank}.json").read_text()) for rank in (0, 1)]


def test_two_devices_train_with_ddp_over_the_neuron_backend_with_two_cpu_ranks_bits(tmp_path):
    neuron, cpu = _run_ddp(tmp_path, "neuron"), _run_ddp(tmp_path, "cpu")
    for rank in (0, 1):
        assert (neuron[rank]["strategy"], neuron[rank]["root"], neuron[rank]["backend"]) == \
            ("NeuronDDPStrategy", f"neuron:{rank}", "neuron")
        assert neuron[rank]["state"] == cpu[rank]["state"]
        # 4 steps an epoch on each rank; the second epoch's: forward and backward, the all-reduce, the step
        assert max(neuron[rank]["launches"][-4:]) <= 3, neuron[rank]["launches"]
    assert cpu[0]["state"] == cpu[1]["state"]  # DDP kept the ranks in step: the comparison means something
