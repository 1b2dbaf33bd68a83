"""Adaptive eager at real depth (issue 15): a training step of any depth fuses into one launch,
or into the fewest consecutive traces when it is longer than the longest trace, with the
same warm-up as a small loop and eager's bits.

The models are our own small ones (a GPT-style stack, a very deep MLP), so the counts depend
on nothing but the engine. A 64-layer stack's step (1,882 ops) ran as 154 per-layer launches
for ever: its identical layers' traces, matched back to back, paused detection before the
step could repeat twice.
"""
import io
import math

import pytest
import torch
import torch.nn.functional as F

import adaptive_eager
from models import TinyGPT
from subproc import run_json

WARMUP = 5  # steps before the steady state, at most (the bound)


def _train_stack(mode: str, layers: int, steps: int, read_loss: bool = False):
    """(losses, parameters, (ops, launches) per step) of `steps` AdamW steps in `mode`."""
    torch.manual_seed(0)
    model = TinyGPT(layers, vocab=16, dim=8, context=4).to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 16, (2, 4), generator=gen).to("neuron")
    target = torch.randint(0, 16, (2, 4), generator=gen).to("neuron")
    losses, per_step = [], []
    with adaptive_eager.mode(mode):
        for _ in range(steps):
            before = adaptive_eager.stats(wait=False)
            loss = F.cross_entropy(model(idx).view(-1, 16), target.view(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item() if read_loss else loss.detach())
            torch.neuron.synchronize()
            after = adaptive_eager.stats()
            per_step.append((after.ops - before.ops, after.launches - before.launches))
    losses = [float(x) for x in losses]
    return losses, [p.detach().cpu() for p in model.parameters()], per_step


def _assert_bitwise(a, b):
    assert a[0] == b[0]
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


@pytest.mark.parametrize("layers", [24, 64])
def test_a_deep_stack_runs_one_launch_per_step_after_the_usual_warm_up(layers):
    steps = WARMUP + 3
    eager = _train_stack("eager", layers, steps)
    adaptive = _train_stack("adaptive", layers, steps)
    _assert_bitwise(eager, adaptive)
    ops, launches = zip(*adaptive[2][WARMUP:])
    assert min(ops) > 25 * layers  # the whole step: the model's ops, not a layer's
    assert launches == (1,) * len(launches), adaptive[2]


def test_a_deep_stack_that_reads_its_loss_every_step_runs_at_most_two_launches():
    steps = WARMUP + 3
    eager = _train_stack("eager", 64, steps, read_loss=True)
    adaptive = _train_stack("adaptive", 64, steps, read_loss=True)
    _assert_bitwise(eager, adaptive)
    assert all(launches <= 2 for _, launches in adaptive[2][WARMUP:]), adaptive[2]


_CHAINED = """
    import torch, adaptive_eager
    from torch import nn
    torch.manual_seed(0)
    layers = LAYERS
    out = {}
    for mode in ("eager", "adaptive"):
        adaptive_eager.set_mode(mode)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), *[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(layers)],
                              nn.Linear(4, 1)).to("neuron")
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        x = torch.linspace(-1, 1, 32).reshape(8, 4).to("neuron")
        losses, per_step = [], []
        for step in range(8):
            before = adaptive_eager.stats(wait=False)
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
            torch.neuron.synchronize()
            after = adaptive_eager.stats()
            per_step.append((after.ops - before.ops, after.launches - before.launches))
        out[mode] = {"losses": [float(v) for v in losses], "per_step": per_step,
                     "params": [p.detach().cpu().flatten().tolist() for p in model.parameters()]}
    emit(out)
"""


@pytest.mark.parametrize("layers, max_trace_len", [(100, 400), (2500, None)])
def test_a_step_longer_than_the_longest_trace_runs_as_the_fewest_consecutive_traces(layers, max_trace_len):
    # A 2,500-layer MLP: a step of 15,017 ops, under the default longest trace (16,384 ops);
    # 100 layers (617 ops) against a longest trace of 400: two traces, the first naming the
    # second (a unit up to twice the longest trace is looked for: EngineConfig.max_period).
    env = {"NEURON_MAX_TRACE_LEN": str(max_trace_len)} if max_trace_len else {"NEURON_MAX_TRACE_LEN": None}
    out = run_json(_CHAINED.replace("LAYERS", str(layers)), env=env)
    eager, adaptive = out["eager"], out["adaptive"]
    assert adaptive["losses"] == eager["losses"] and adaptive["params"] == eager["params"]
    ops = adaptive["per_step"][-1][0]
    expected = math.ceil(ops / (max_trace_len or 16384))
    assert [launches for _, launches in adaptive["per_step"][WARMUP:]] == [expected] * 3, adaptive["per_step"]


def test_an_empty_tensor_made_from_host_data_is_no_sync_point():
    # torch.tensor([], device='neuron'), as Hugging Face's DynamicCache makes per layer and
    # step, synced: it cut GPT-2's step into one trace per layer (17 launches at 16 layers).
    x = torch.ones(4).to("neuron")
    per_step = []
    for _ in range(WARMUP + 3):
        before = adaptive_eager.stats(wait=False)
        y = x * 2
        empty = torch.tensor([], device="neuron")
        y = torch.cat([empty, y]).sigmoid()
        x = (y + 1).exp().log()
        torch.neuron.synchronize()
        per_step.append(adaptive_eager.stats().launches - before.launches)
    assert per_step[WARMUP:] == [1, 1, 1]
    assert torch.equal(x.cpu(), _eager_empty_loop())


def _eager_empty_loop():
    with adaptive_eager.mode("eager"):
        x = torch.ones(4).to("neuron")
        for _ in range(WARMUP + 3):
            y = torch.cat([torch.tensor([], device="neuron"), x * 2]).sigmoid()
            x = (y + 1).exp().log()
        return x.cpu()


def _train_with_saves(mode: str, steps: int = 16, save_at=(7, 11), eval_at=()):
    """A loop that keeps each step's loss (a value of the step before, live across the cut) and
    saves a checkpoint (host reads of every parameter) between some steps, or evaluates (a
    validation batch without gradients, its loss read) after some steps, outside the count."""
    torch.manual_seed(0)
    model = TinyGPT(4, vocab=16, dim=8, context=4).to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(0, 16, (2, 4), generator=torch.Generator().manual_seed(1)).to("neuron")
    val = torch.randint(0, 16, (3, 4), generator=torch.Generator().manual_seed(2)).to("neuron")
    losses, launches, val_losses = [], [], []
    with adaptive_eager.mode(mode):
        for step in range(steps):
            before = adaptive_eager.stats(wait=False).launches
            loss = F.cross_entropy(model(idx).view(-1, 16), idx.view(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
            if step in save_at:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, io.BytesIO())
            torch.neuron.synchronize()
            launches.append(adaptive_eager.stats().launches - before)
            if step in eval_at:
                model.eval()
                with torch.no_grad():
                    for _ in range(3):  # an eval phase repeats too: it may get traces of its own
                        val_losses.append(F.cross_entropy(model(val).view(-1, 16), val.view(-1)).item())
                model.train()
    return [float(x) for x in losses] + val_losses, [p.detach().cpu() for p in model.parameters()], launches


def test_a_checkpoint_saved_between_steps_leaves_the_next_steps_at_one_launch():
    # Issue 15's recovery: after an interruption the next step is back at its steady launches,
    # its trace starting where the step starts (the issue saw a whole step run unfused after a save).
    eager, adaptive = _train_with_saves("eager"), _train_with_saves("adaptive")
    _assert_bitwise(eager, adaptive)
    assert adaptive[2][WARMUP:] == [1] * (16 - WARMUP), adaptive[2]


def test_an_eval_phase_between_steps_leaves_the_next_steps_at_one_launch():
    eager = _train_with_saves("eager", save_at=(), eval_at=(6, 7, 11))
    adaptive = _train_with_saves("adaptive", save_at=(), eval_at=(6, 7, 11))
    _assert_bitwise(eager, adaptive)
    assert adaptive[2][WARMUP:] == [1] * (16 - WARMUP), adaptive[2]
