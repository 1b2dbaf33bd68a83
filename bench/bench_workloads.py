"""The comparison suite: seven workloads, each timed in every mode in ONE benchmark group.

Modes: `cpu` (native CPU eager), `neuron-eager`, `neuron-adaptive`, and the anchors
`lazy` (torch._lazy, TorchScript backend, `mark_step` placed by hand after each step) and
`compile` (torch.compile, inductor on CPU). An anchor that fails on a workload is skipped
with its error AND recorded under "anchor_failures" in the pytest-benchmark JSON
(bench/conftest.py), never dropped silently.

The neuron modes run with both launch-overhead settings: `modelled` (only added to the
emulated device clock) and `spent` (also spun in wall-clock time, as a blocked host would).
Every benchmark attaches `workload`, `mode`, `overhead` to extra_info; the neuron ones add,
per timed step: ops, launches, transfers, emulated device µs, peak device memory and the
launch-overhead setting. Compare ratios, not absolute times (shared, noisy machines).

    python -m pytest bench/bench_workloads.py -q --benchmark-only [--quick]
    adaptive-eager bench [--quick]       # the same, plus one table of ratios per workload
"""
from __future__ import annotations

import contextlib
import itertools
import math
import os

import pytest
import torch
import torch.nn.functional as F

import adaptive_eager
from adaptive_eager.device import native
from adaptive_eager.dispatch import CONTEXT

# name -> (warm-up steps, full (rounds, iterations), quick (rounds, iterations)).
# Warm-up is the same in quick mode: adaptive mode must reach its steady state before timing.
# The small workloads' steps take a millisecond or two: quick mode still times 15 rounds of
# them, since a median of 5 moved adaptive/eager by 0.2-0.4 between runs of one build.
WORKLOADS = {
    "mlp-train": (40, (20, 5), (15, 2)),
    "transformer-train": (40, (12, 2), (10, 1)),
    "mlp-infer": (40, (20, 20), (15, 10)),
    "decode": (60, (20, 20), (15, 5)),
    "matmul-heavy": (40, (10, 2), (7, 1)),
    "deep-train": (8, (5, 1), (3, 1)),
    # generate() diverges at every call's last token: detection pauses once it has found
    # nothing new for a while (Note [Detection that finds nothing pauses]). Its five prompts
    # (one ending in the pad token, whose tokens take a longer mask path) repeat exactly only
    # every five calls, and each prompt length's prefill is learnt on its own visits: the
    # calls settle to a fixed cycle of launches by about the 57th (tests/clients/
    # test_hf_generate.py, the padded-prompt test), and detection pauses for good by about
    # the 70th. Mean ms a call, one run (OMP_NUM_THREADS=1): calls 0-31 / 32-99 / 100-299:
    # adaptive 25.2 / 19.7 / 12.6, eager 11.8 / 11.2 / 11.2, CPU 6.6 / 6.3 / 6.3.
    # Since the done flag's bool is lifted (Note [Lifted scalars]) the last token completes
    # its trace, and detection's quiet pauses fall elsewhere: it looks again around calls
    # 85-108 and 165-175, and pauses for good (262k ops) from about the 175th. The warm-up
    # covers that, so the timed calls are the steady state, as for every other workload.
    "hf-decode": (200, (5, 1), (3, 1)),
}
# Launch-bound workloads are also measured with the overhead spent in wall-clock time;
# matmul-heavy is compute-bound, so there the setting changes nothing worth the minutes.
SPENT_OVERHEAD = ("mlp-train", "transformer-train", "mlp-infer", "decode")
NEURON_MODES = ("neuron-eager", "neuron-adaptive")
ANCHORS = ("lazy", "compile")
# deep-train's anchors would time compilers on a 48-layer graph (minutes each), not the step;
# hf-decode's graphs change shape every token (each would recompile): both are measured against
# CPU and neuron eager only.
NO_ANCHORS = ("deep-train", "hf-decode")


def _cases():
    for workload in WORKLOADS:
        yield workload, "cpu", "n/a"
        for mode in NEURON_MODES:
            yield workload, mode, "modelled"
            if workload in SPENT_OVERHEAD:
                yield workload, mode, "spent"
        for anchor in () if workload in NO_ANCHORS else ANCHORS:
            yield workload, anchor, "n/a"


CASES = [pytest.param(w, m, o, id=f"{w}-{m}" + ("" if o == "n/a" else f"-{o}"),
                      marks=pytest.mark.benchmark(group=w))
         for w, m, o in _cases()]


# -- models ----------------------------------------------------------------------------------

def _mlp(device):
    return torch.nn.Sequential(
        torch.nn.Linear(256, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 10)).to(device)


class Block(torch.nn.Module):
    """Pre-norm decoder block; attention written out (no fused SDPA) so every mode runs the same ops."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))

    def _split(self, t):  # (B, T, W) -> (B, H, T, W/H)
        b, s, w = t.shape
        return t.view(b, s, self.heads, w // self.heads).transpose(1, 2)

    def _attend(self, q, k, v, mask):
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        return att @ v

    def forward(self, x, mask):
        q, k, v = self.qkv(self.ln1(x)).split(x.shape[-1], -1)
        y = self._attend(self._split(q), self._split(k), self._split(v), mask)
        x = x + self.proj(y.transpose(1, 2).reshape(x.shape))
        return x + self.mlp(self.ln2(x))

    def decode(self, x, pos, cache_k, cache_v, mask):
        """One token (x: (1, 1, W)) against a PREALLOCATED cache (1, H, MAXLEN, W/H): the new
        key/value are written in place with index_copy_ at a position held in a device tensor,
        and attention covers the whole cache under a mask. Every token thus runs the same ops
        on the same shapes (a growing torch.cat cache would change shapes every token and
        never repeat), which is what lets the adaptive engine fuse the token step."""
        q, k, v = self.qkv(self.ln1(x)).split(x.shape[-1], -1)
        cache_k.index_copy_(2, pos, self._split(k))
        cache_v.index_copy_(2, pos, self._split(v))
        y = self._attend(self._split(q), cache_k, cache_v, mask)
        x = x + self.proj(y.transpose(1, 2).reshape(x.shape))
        return x + self.mlp(self.ln2(x))


class TinyDecoder(torch.nn.Module):
    def __init__(self, vocab=256, width=64, heads=4, layers=2, maxlen=32):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, width)
        self.pos = torch.nn.Embedding(maxlen, width)
        self.blocks = torch.nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens):  # (B, T) -> (B, T, vocab)
        t = tokens.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=tokens.device).triu(1)
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x, causal)
        return self.head(self.ln_f(x))


# -- workloads: build(device, mode) -> step() ----------------------------------------------------
# The data comes from a CPU generator and is moved once, so every mode sees the same numbers.

def _data(*shape, high=None):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, high, shape, generator=g) if high else torch.randn(*shape, generator=g)


def _mlp_train(device, mode):
    model = _mlp(device)
    opt = torch.optim.AdamW(model.parameters())
    x, y = _data(64, 256).to(device), _data(64, high=10).to(device)

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return step


def _transformer_train(device, mode):
    model = TinyDecoder().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    # Warm-up then cosine decay: the learning rate is a new Python float every step.
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * min(s, 1000) / 1000)))
    tokens = _data(8, 33, high=256).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step():
        opt.zero_grad()
        logits = model(inputs)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    return step


def _mlp_infer(device, mode):
    model = _mlp(device).eval()
    x = _data(64, 256).to(device)

    def step():
        with torch.inference_mode():
            return model(x)
    return step


def _decode(device, mode):
    """One step = one generated token (greedy), batch 1, preallocated KV cache of 32
    positions; the position wraps around, so the benchmark can run any number of tokens."""
    maxlen = 32
    model = TinyDecoder(maxlen=maxlen).to(device).eval()
    heads, width = model.blocks[0].heads, model.tok.embedding_dim
    shape = (1, heads, maxlen, width // heads)
    caches = [(torch.zeros(shape, device=device), torch.zeros(shape, device=device))
              for _ in model.blocks]
    slots = torch.arange(maxlen, device=device)
    state = {"tok": torch.zeros(1, 1, dtype=torch.long, device=device),
             "pos": torch.zeros(1, dtype=torch.long, device=device)}

    def token(tok, pos):
        mask = slots > pos  # hide the cache slots not written yet (or left from the last lap)
        x = model.tok(tok) + model.pos(pos)
        for block, (ck, cv) in zip(model.blocks, caches):
            x = block.decode(x, pos, ck, cv, mask)
        nxt = model.head(model.ln_f(x)).argmax(-1)  # stays on the device: no sync per token
        pos.add_(1).remainder_(maxlen)
        return nxt

    if mode == "compile":
        token = torch.compile(token)

    def step():
        with torch.inference_mode():
            state["tok"] = token(state["tok"], state["pos"])
    return step


def _matmul_heavy(device, mode):
    """Four chained 512x512 matmuls: compute dominates, launches are few."""
    a = _data(512, 512).to(device) * 0.04
    b = _data(512, 512).to(device) * 0.04

    def step():
        c = a
        for _ in range(4):
            c = torch.mm(c, b)
        return c
    return step


def _deep_train(device, mode):
    """A 48-layer decoder (width 32), AdamW: a step of thousands of ops, which adaptive mode
    must still run as one launch (issue 15)."""
    model = TinyDecoder(width=32, heads=2, layers=48).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    tokens = _data(2, 17, high=256).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step():
        opt.zero_grad()
        logits = model(inputs)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
        opt.step()
    return step


HF_DECODE_TOKENS = 8


def _hf_decode(device, mode):
    """Hugging Face GPT-2 (2 layers, width 32) generate(), greedy, default DynamicCache: one
    step is one call of HF_DECODE_TOKENS new tokens from a prompt whose length changes call to
    call, the cache growing a position per token. No token's shapes ever repeat exactly:
    adaptive mode runs each token as one launch of a shape-generic trace (issue 15)."""
    transformers = pytest.importorskip("transformers", reason="hf-decode needs the clients extra: "
                                       "pip install -e '.[clients]'")
    transformers.logging.set_verbosity_error()
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=2)).to(device).eval()
    prompts = [_data(1, n, high=64).to(device) for n in (6, 9, 7, 10, 8)]
    calls = itertools.count()

    def step():
        prompt = prompts[next(calls) % len(prompts)]
        return model.generate(prompt, max_new_tokens=HF_DECODE_TOKENS, do_sample=False, pad_token_id=0)
    return step


BUILDERS = {"mlp-train": _mlp_train, "transformer-train": _transformer_train,
            "mlp-infer": _mlp_infer, "decode": _decode, "matmul-heavy": _matmul_heavy,
            "deep-train": _deep_train, "hf-decode": _hf_decode}


# -- modes ----------------------------------------------------------------------------------------

_LAZY_READY = []


def _lazy_init() -> None:
    """torch._lazy's TorchScript backend may be initialised only once per process."""
    if not _LAZY_READY:
        import torch._lazy
        import torch._lazy.ts_backend

        torch._lazy.ts_backend.init()
        _LAZY_READY.append(True)


def _build_step(workload: str, mode: str):
    torch.manual_seed(0)
    device = {"lazy": "lazy", "cpu": "cpu", "compile": "cpu"}.get(mode, "neuron")
    if mode == "lazy":
        _lazy_init()
    inner = BUILDERS[workload](device, mode)
    if mode == "compile" and workload != "decode":  # decode compiles its token function itself
        inner = torch.compile(inner)
    # The step's output stays referenced until the next step: a lazy mark_step (or a deferred
    # launch) only has to compute live values, and a dropped output would make lazy look free.
    last = [None]

    def step():
        last[0] = inner()
        if mode == "lazy":
            torch._lazy.mark_step()
    return step


@contextlib.contextmanager
def _overhead(setting: str):
    runtime = CONTEXT.runtime
    previous = runtime.set_spend_launch_overhead(setting == "spent")
    try:
        yield
    finally:
        runtime.set_spend_launch_overhead(previous)


def _attach_counters(benchmark, before, after, steps: int) -> None:
    """Per-step figures of the timed steps themselves. Counting them in extra, untimed steps
    after a reset_stats() would be wrong for the adaptive engine: reset_stats synchronizes,
    which shifts where the engine's traces start, and the steps after it may fuse differently
    (transformer-train: 3 launches per step while timed, 1.1 after such a reset)."""
    def per_step(field):
        return (getattr(after, field) - getattr(before, field)) / steps

    benchmark.extra_info.update(
        ops_per_step=per_step("ops"),
        launches_per_step=per_step("launches"),
        fused_launches_per_step=per_step("fused_launches"),
        transfers_per_step=per_step("transfers"),
        device_us_per_step=round(per_step("device_time_us"), 3),
        peak_device_memory_bytes=after.peak_memory_bytes,  # over the whole benchmark
        launch_overhead_us_setting=torch.neuron.get_device_properties(0).launch_overhead_us,
        launch_overhead_spent=CONTEXT.runtime.config.spend_launch_overhead,
        divergences=after.divergences - before.divergences,
        counted_steps=steps,
    )


def _error_text(err: Exception, limit: int = 400) -> str:
    """The exception's type and first line (inductor and lazy errors run to pages)."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    text = f"{type(err).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def quick_mode(config) -> bool:
    return bool(config.getoption("--quick", default=False)) or \
        os.environ.get("ADAPTIVE_EAGER_BENCH_QUICK", "").strip() not in ("", "0")


@pytest.mark.parametrize("workload, mode, overhead", CASES)
def test_workload(benchmark, request, anchor_failures, workload, mode, overhead):
    warmup, full, quick = WORKLOADS[workload]
    rounds, iterations = quick if quick_mode(request.config) else full
    benchmark.extra_info.update(workload=workload, mode=mode, overhead=overhead)
    engine_mode = "adaptive" if mode == "neuron-adaptive" else "eager"
    with adaptive_eager.mode(engine_mode), _overhead("spent" if overhead == "spent" else "modelled"):
        try:
            step = _build_step(workload, mode)
            for _ in range(warmup):
                step()
        except Exception as err:  # noqa: BLE001  (any failure of an anchor is the result)
            if mode not in ANCHORS:
                raise
            error = _error_text(err)
            anchor_failures.append(dict(workload=workload, mode=mode, error=error))
            pytest.skip(f"anchor {mode} failed on {workload}: {error}")
        calls = [0]
        on_device = mode in NEURON_MODES

        def counted_step():
            calls[0] += 1
            step()
            # The device runs asynchronously (Note [The device executor]): a round's time
            # includes its work having run, as a CUDA benchmark synchronizes before reading
            # the clock. Without this, eager mode timed only its issue (matmul-heavy read
            # 0.002x CPU). Waits for what was issued, without cutting the engine's traces.
            if on_device and calls[0] % iterations == 0:
                native.wait_for_device()
        # Counters are read without a sync (stats() waits for the device stream, not for what
        # is held back): the work pending at both ends is the same steady-state amount, so the
        # difference is per-step exact enough.
        before = adaptive_eager.stats()
        benchmark.pedantic(counted_step, rounds=rounds, iterations=iterations, warmup_rounds=1)
        after = adaptive_eager.stats()
        if mode in NEURON_MODES:
            _attach_counters(benchmark, before, after, calls[0])
