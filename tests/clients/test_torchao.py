"""FP8 and quantization on neuron with torchao, and an MoE layer on torch._grouped_mm (issue 17):
trained or run on CPU, on neuron op by op and on neuron in adaptive mode, bitwise CPU's.

torchao's float8 training (`convert_to_float8_training`) computes its matmuls with
torch._scaled_mm, tensorwise scaled float8_e4m3fn (e5m2 for gradients): priced at the FP8 rate
(Note [Matmul rates]; on trn2, whose Tensor Engine lacks e4m3fn, at the bf16 rate with a
warning). `Float8DynamicActivationFloat8WeightConfig` does not run: torchao 0.18's
_check_hardware_support asserts a CUDA (sm >= 8.9), MI300+ or XPU device, with no hook for
another backend (a test below pins that).
"""
from __future__ import annotations

import json
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import adaptive_eager
from clients import assert_bitwise, require, train
from subproc import run_python

torchao = require("torchao")
from torchao.float8 import convert_to_float8_training  # noqa: E402
from torchao.quantization import (Float8DynamicActivationFloat8WeightConfig, Float8WeightOnlyConfig,  # noqa: E402
                                  Int8WeightOnlyConfig, quantize_)

STEPS = 10
WARMUP = 5


class Block(nn.Module):
    """A pre-norm transformer block and an LM head, every Linear's dims multiples of 16 (float8)."""

    def __init__(self, vocab=64, dim=64, heads=4, ffn=128):
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, dim)
        self.ln1, self.ln2, self.ln3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, ffn), nn.Linear(ffn, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids, labels):
        x = self.tok(ids)
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        logits = self.head(self.ln3(x))
        return types.SimpleNamespace(loss=F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)))


def _float8_block():
    return convert_to_float8_training(Block())


def _tokens(g):
    ids = torch.randint(0, 64, (4, 16), generator=g)
    return {"ids": ids, "labels": ids.roll(-1, 1)}


def _quiet(fn):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Tensor Engine does not take.*")
        return fn()


def test_float8_training_is_cpus_bits_in_both_modes_and_fuses():
    cpu = train("cpu", "eager", _float8_block, _tokens, STEPS)
    eager = _quiet(lambda: train("neuron", "eager", _float8_block, _tokens, STEPS))
    adaptive = _quiet(lambda: train("neuron", "adaptive", _float8_block, _tokens, STEPS))
    assert_bitwise(cpu, eager)
    assert_bitwise(cpu, adaptive)
    assert max(adaptive.launches[WARMUP:]) <= 2, adaptive.launches  # the loss.item() read splits a step


def test_float8_training_matmuls_are_scaled_fp8_launches_on_neuron():
    from torch.profiler import ProfilerActivity, profile
    model = _float8_block().to("neuron")
    batch = {k: v.to("neuron") for k, v in _tokens(torch.Generator().manual_seed(0)).items()}
    with adaptive_eager.mode("eager"), profile(activities=[ProfilerActivity.CPU]) as prof:
        _quiet(lambda: model(**batch).loss.backward())
    launched = [e.name for e in prof.events() if e.name.startswith("neuron::aten::")]
    # 6 Linears: the forward and the weight gradient of each (and the input gradients) are
    # scaled fp8 matmuls; no matmul is left in high precision
    assert launched.count("neuron::aten::_scaled_mm") >= 12
    assert not {"neuron::aten::mm", "neuron::aten::addmm", "neuron::aten::bmm"} & set(launched)


# One MLP block whose matmuls are compute-bound (512 on every side), a float8 training step
# against the same step in bf16, adaptive (one launch), on the trn3 profile; each priced op's
# time from the op log, split into the matmuls and the rest.
_STEP_TIMES = """
    import json, warnings, torch, adaptive_eager
    from torch import nn
    from adaptive_eager.device import native
    from torchao.float8 import convert_to_float8_training
    warnings.filterwarnings("ignore")
    MATMULS = {"aten::mm", "aten::_scaled_mm"}
    out = {}
    for fp8 in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(512, 512, bias=False), nn.GELU(), nn.Linear(512, 512, bias=False))
        model = model.to(torch.bfloat16)
        if fp8:
            model = convert_to_float8_training(model)
        model = model.to("neuron")
        # torchao computes every input gradient: so does bf16 here, for the same FLOPs
        x = torch.randn(512, 512, dtype=torch.bfloat16, device="neuron", requires_grad=True)
        with adaptive_eager.mode("adaptive"):
            for step in range(6):
                adaptive_eager.reset_stats()
                native.set_op_log(step == 5)
                model(x).float().pow(2).mean().backward()
                for p in [x, *model.parameters()]:
                    p.grad = None
                s = adaptive_eager.stats()
        ops = native.take_op_log()
        native.set_op_log(False)
        out["fp8" if fp8 else "bf16"] = {
            "launches": s.launches, "busy": s.device_time_us - s.launch_overhead_us,
            "matmul": sum(us for name, us in ops if name in MATMULS),
            "matmuls": sorted(name for name, _ in ops if name in MATMULS),
            "other": sum(us for name, us in ops if name not in MATMULS)}
    print(json.dumps(out))
"""


def test_float8_matmuls_take_half_the_bf16_time_on_trn3_and_the_scaling_costs_the_rest():
    proc = run_python(_STEP_TIMES, env={"NEURON_PROFILE": "trn3"})
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    bf16, fp8 = got["bf16"], got["fp8"]
    assert bf16["launches"] == fp8["launches"] == 1
    # the forward, input-gradient and weight-gradient matmuls of both Linears: the same FLOPs,
    # at 2 x 671 TFLOPS against 671
    assert bf16["matmuls"] == ["aten::mm"] * 6 and fp8["matmuls"] == ["aten::_scaled_mm"] * 6
    assert fp8["matmul"] == pytest.approx(bf16["matmul"] / 2, rel=1e-9)
    # every op's time is in the log, and the dynamic scaling (amax, scale, cast of every
    # operand) is Vector Engine work the bf16 step does not have
    for run in (bf16, fp8):
        assert run["matmul"] + run["other"] == pytest.approx(run["busy"], rel=1e-9)
    assert fp8["other"] > bf16["other"]


def test_int8_and_float8_weight_only_inference_give_cpus_outputs():
    for config in (Int8WeightOnlyConfig(), Float8WeightOnlyConfig()):
        torch.manual_seed(0)
        ref = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)).to(torch.bfloat16)
        dev = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)).to(torch.bfloat16)
        dev.load_state_dict(ref.state_dict())
        quantize_(ref, config)
        dev = dev.to("neuron")
        quantize_(dev, config)
        x = torch.randn(16, 64, dtype=torch.bfloat16)
        for mode in ("eager", "adaptive"):
            with adaptive_eager.mode(mode):
                outs = [dev(x.to("neuron")).cpu() for _ in range(6)]
            assert all(torch.equal(o, ref(x)) for o in outs), (type(config).__name__, mode)


def test_float8_dynamic_activation_quantization_stops_at_torchaos_hardware_check():
    model = nn.Sequential(nn.Linear(64, 64)).to(torch.bfloat16).to("neuron")
    with pytest.raises(AssertionError, match="requires CUDA compute capability"):
        quantize_(model, Float8DynamicActivationFloat8WeightConfig())


class GroupedMoE(nn.Module):
    """Top-k routed experts computed with torch._grouped_mm: tokens sorted by expert, one grouped
    GEMM per projection, weighted and scattered back. Counts by scatter_add (no host read)."""

    def __init__(self, dim=32, experts=4, hidden=64, top_k=2):
        super().__init__()
        self.e, self.k = experts, top_k
        self.router = nn.Linear(dim, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, dim, hidden) * 0.1)
        self.w_out = nn.Parameter(torch.randn(experts, hidden, dim) * 0.1)
        self.head = nn.Linear(dim, 8)

    def forward(self, x, y):
        weights, chosen = self.router(x).softmax(-1).topk(self.k, dim=-1)
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)
        tokens = order // self.k
        counts = torch.zeros(self.e, dtype=torch.int64, device=x.device).scatter_add(0, flat, torch.ones_like(flat))
        offs = counts.cumsum(0).to(torch.int32)
        h = F.silu(torch._grouped_mm(x[tokens], self.w_in, offs=offs))
        ys = torch._grouped_mm(h, self.w_out, offs=offs) * weights.reshape(-1)[order].unsqueeze(1)
        out = torch.zeros_like(x).index_add(0, tokens, ys)
        return types.SimpleNamespace(loss=F.mse_loss(self.head(x + out), y))


def _moe_batch(g):
    return {"x": torch.randn(48, 32, generator=g), "y": torch.randn(48, 8, generator=g)}


def test_an_moe_layer_on_grouped_mm_trains_to_cpus_bits_and_fuses():
    cpu = train("cpu", "eager", GroupedMoE, _moe_batch, STEPS)
    for mode in ("eager", "adaptive"):
        run = train("neuron", mode, GroupedMoE, _moe_batch, STEPS)
        assert_bitwise(cpu, run)
    assert max(run.launches[WARMUP:]) <= 2, run.launches
