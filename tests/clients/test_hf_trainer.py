"""The Hugging Face Trainer trains on neuron, in adaptive mode, as it trains on CPU.

transformers and accelerate pick a Neuron device only when a `torch_neuronx` package is
installed; the emulator is not that package, so a user selects the device the way accelerate
documents for any device: ACCELERATE_TORCH_DEVICE=neuron (README, "Hugging Face"). The Trainer
then moves the model again in accelerate's `prepare` (a second `.to('neuron')` of a model
already there), clips gradients, steps a linear LR schedule and reads the loss and gradient
norm on the host every step.
"""
from __future__ import annotations

import torch

import adaptive_eager
from clients import host_state, require

transformers = require("transformers")
require("accelerate")
from accelerate.state import AcceleratorState  # noqa: E402

transformers.logging.set_verbosity_error()

STEPS = 10
VOCAB = 64


class _Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, VOCAB, (4 * STEPS, 12), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class _Launches(transformers.TrainerCallback):
    def __init__(self):
        self.per_step, self._before = [], 0

    def on_step_begin(self, args, state, control, **kwargs):
        self._before = adaptive_eager.stats().launches

    def on_step_end(self, args, state, control, **kwargs):
        self.per_step.append(adaptive_eager.stats().launches - self._before)


def _fit(tmp_path, **arguments):
    # accelerate's state is a process-wide singleton: each Trainer starts from none.
    AcceleratorState._reset_state(reset_partial_state=True)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    args = transformers.TrainingArguments(**(dict(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4, learning_rate=1e-3,
        logging_steps=1, report_to=[], save_strategy="no", seed=0, disable_tqdm=True) | arguments))
    launches = _Launches()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=[launches])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    device = next(model.parameters()).device
    AcceleratorState._reset_state(reset_partial_state=True)
    return losses, norms, host_state(model), device, launches.per_step


def test_trainer_in_adaptive_mode_is_bitwise_cpus(tmp_path, monkeypatch):
    cpu = _fit(tmp_path / "cpu", use_cpu=True)
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "neuron")
    with adaptive_eager.mode("adaptive"):
        neuron = _fit(tmp_path / "neuron")
    assert cpu[3].type == "cpu" and neuron[3].type == "neuron"
    assert len(neuron[0]) == STEPS and neuron[0] == cpu[0]
    assert neuron[1] == cpu[1]
    differ = [k for k in cpu[2] if not torch.equal(cpu[2][k], neuron[2][k])]
    assert not differ, differ
    assert max(neuron[4][5:]) <= 4, f"launches per step {neuron[4]}"  # eager: ~150


def test_without_the_variable_the_trainer_stays_on_cpu_as_transformers_decides(tmp_path, monkeypatch):
    # What a user sees who sets nothing: transformers looks for torch_neuronx, finds none, and
    # trains on the CPU. This pins the reason the README asks for ACCELERATE_TORCH_DEVICE.
    monkeypatch.delenv("ACCELERATE_TORCH_DEVICE", raising=False)
    assert _fit(tmp_path, max_steps=1)[3].type == "cpu"
