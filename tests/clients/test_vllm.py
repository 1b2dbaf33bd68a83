"""vLLM serving on the emulated device (issue 18): vLLM's own engine, scheduler and sampler,
with our platform plugin (adaptive_eager/vllm_platform) selected by VLLM_TARGET_DEVICE=neuron.

A tiny random Llama (2 layers, grouped-query attention, head_dim 64) is written by the test;
nothing is downloaded. Each vLLM run is a process of its own (vllm_child.py): vLLM resolves
its platform once per process.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request

import pytest
import torch

from clients import require

vllm = require("vllm", extra="vllm")
transformers = require("transformers", extra="vllm")

from vllm_child import run_child, write_tiny_llama  # noqa: E402

MAX_TOKENS = 12
DECODE_STEPS = 16
# Prompts of different lengths; the 40-token one spans two KV-cache blocks of 32.
PROMPT_LENGTHS = (3, 7, 1, 40, 12)
SEEDS = (3, 4)
# Batches of new requests with the prompts' lengths, one after another (vllm_child._serve).
SERVE_CALLS = 4


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _env(device: str | None, mode: str = "1") -> dict:
    env = dict(os.environ)
    env.pop("VLLM_TARGET_DEVICE", None)
    if device is not None:
        env["VLLM_TARGET_DEVICE"] = device
    # The engine core in this process: the child reads the model runner it drives.
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env["NEURON_ADAPTIVE_EAGER"] = mode
    env["VLLM_NO_USAGE_STATS"] = "1"
    return env


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="module")
def runs(checkpoint):
    spec = {"model": checkpoint, "prompts": _prompts(), "max_tokens": MAX_TOKENS}
    neuron = {"seeds": SEEDS, "decode": DECODE_STEPS, "serve_calls": SERVE_CALLS}
    return {
        "adaptive": run_child({**spec, **neuron}, _env("neuron", "1")),
        "eager": run_child({**spec, **neuron}, _env("neuron", "0")),
        "vllm_cpu": run_child(spec, _env(None)),
    }


def _hf_greedy(checkpoint) -> list[list[int]]:
    model = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in _prompts():
            tokens = torch.tensor([ids])
            for _ in range(MAX_TOKENS):
                next_token = model(tokens).logits[0, -1].argmax()
                tokens = torch.cat([tokens, next_token.view(1, 1)], dim=1)
            out.append(tokens[0, len(ids):].tolist())
    return out


def test_the_plugin_answers_only_when_the_user_selects_neuron(monkeypatch):
    from adaptive_eager.vllm_platform import PLATFORM, platform_plugin

    # Selected, the plugin adds a metadata finder (Note [The vllm distribution name]): this
    # process's finders are restored after the test.
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
    assert platform_plugin() is None
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    assert platform_plugin() is None
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm")
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "neuron")
    assert platform_plugin() == PLATFORM
    # vllm-cpu found as "vllm", versioned as vLLM names that build: vLLM still detects its CPU
    # platform by the version (a bare "0.32.0" had it find none, and load AVX-512 kernels)
    assert importlib.metadata.version("vllm") == importlib.metadata.version("vllm-cpu") + "+cpu"
    from vllm.platforms import vllm_version_matches_substr

    assert vllm_version_matches_substr("cpu")
    # vLLM finds it through the entry point the package installs
    from importlib.metadata import entry_points

    (ep,) = [ep for ep in entry_points(group="vllm.platform_plugins") if ep.name == "neuron"]
    assert ep.load() is platform_plugin


GiB = 1 << 30


def test_the_kv_cache_takes_the_users_size_or_the_devices_share_bounded_by_host_memory():
    from adaptive_eager.vllm_platform.worker import kv_cache_budget

    # the user's size, as given, or refused when the device has not that much free
    assert kv_cache_budget(3 * GiB, 20 * GiB, 24 * GiB, 0.9, 1 * GiB, "neuron:0") == 3 * GiB
    with pytest.raises(ValueError, match="kv_cache_memory_bytes=.* is more than the .* free on neuron:0"):
        kv_cache_budget(21 * GiB, 20 * GiB, 24 * GiB, 0.9, 64 * GiB, "neuron:0")
    # no size given: the device's share less the weights, as on a GPU, where the host has room
    assert kv_cache_budget(None, 22 * GiB, 24 * GiB, 0.5, 64 * GiB, "neuron:0") == 12 * GiB - 2 * GiB
    # ... and no more than the share of the host's available memory (the device's bytes are host memory)
    assert kv_cache_budget(None, 22 * GiB, 24 * GiB, 0.5, 8 * GiB, "neuron:0") == 4 * GiB
    with pytest.raises(ValueError, match="no device memory left for the KV cache.*set kv_cache_memory_bytes"):
        kv_cache_budget(None, 4 * GiB, 24 * GiB, 0.5, 64 * GiB, "neuron:0")


def test_vllm_keeps_its_cpu_platform_unless_neuron_is_selected(runs):
    assert runs["vllm_cpu"]["platform"] == "CpuPlatform"
    assert runs["adaptive"]["platform"] == runs["eager"]["platform"] == "NeuronPlatform"


def test_model_kv_cache_and_attention_run_on_neuron_tensors(runs):
    r = runs["adaptive"]
    assert r["parameter_devices"] == ["neuron"]
    assert r["kv_cache_devices"] == ["neuron"]
    assert r["attention_backends"] == ["NeuronPagedAttentionImpl"]


def test_greedy_tokens_on_neuron_equal_hugging_face_on_cpu_and_vllms_cpu_platform(runs, checkpoint):
    expected = _hf_greedy(checkpoint)
    assert len({tuple(t) for t in expected}) == len(expected), "the prompts should not all continue alike"
    assert runs["vllm_cpu"]["greedy"] == expected
    assert runs["adaptive"]["greedy"] == expected
    assert runs["eager"]["greedy"] == expected


def test_seeded_sampling_is_reproducible_run_to_run_and_across_modes(runs):
    a, e = runs["adaptive"], runs["eager"]
    assert a["sampled"] == a["sampled_again"] == e["sampled"] == e["sampled_again"]
    first, second = a["sampled"]
    assert first != second, "two seeds drew the same tokens: the comparison proves nothing"
    assert first != a["greedy"], "sampling at temperature 0.9 gave the greedy tokens"


def test_the_adaptive_engine_fuses_the_decode_step(runs):
    a, e = runs["adaptive"], runs["eager"]
    print(f"\ndecode step ({len(PROMPT_LENGTHS)} requests, one token each): "
          f"eager {e['decode_launches_per_step']:.1f} launches, {e['decode_device_us_per_step']:.1f} us; "
          f"adaptive {a['decode_launches_per_step']:.1f} launches, {a['decode_device_us_per_step']:.1f} us")
    # Eager: every ATen op of the step is a launch (over a hundred for this model). Adaptive:
    # the step's fused launches, cut by vLLM's host-to-device input copies and its host read
    # of the sampled tokens.
    assert e["decode_launches_per_step"] > 100
    assert a["decode_launches_per_step"] <= 4
    assert a["decode_device_us_per_step"] < e["decode_device_us_per_step"] / 5


def test_a_prefill_after_decode_fuses_once_its_batch_has_been_seen_before(runs):
    """Note [Segments that recur apart] (adaptive_eager/engine/segments.py): a server runs
    one prefill per batch of new requests, then their decode steps; the prefill never repeats
    back to back, so the period detector cannot find it. A batch of prompts of the lengths
    seen before (new tokens: no prefix-cache hits) fuses from its second recurrence: its
    first came with the very first generate() call, so the first batch here is the second."""
    a, e = runs["adaptive"], runs["eager"]
    assert a["serve_tokens"] == e["serve_tokens"]
    print(f"\nprefill after decode, batch by batch: eager {e['serve_prefill_launches']}, "
          f"adaptive {a['serve_prefill_launches']} launches")
    assert len(a["serve_prefill_launches"]) == SERVE_CALLS
    assert min(e["serve_prefill_launches"]) > 100
    # As a decode step (test_the_adaptive_engine_fuses_the_decode_step): the step's launches,
    # cut by the input copies and the host read of the sampled tokens. (112 op by op before.)
    assert max(a["serve_prefill_launches"][1:]) <= 4
    decoded = a["serve_decode_launches"]
    assert len(decoded) == SERVE_CALLS * DECODE_STEPS and sum(decoded) / len(decoded) <= 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(server: subprocess.Popen, log) -> str:
    """Ends the server (politely first) and gives what it printed."""
    server.terminate()
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
    log.seek(0)
    return log.read()


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


# `vllm serve`, the command vllm-cpu installs beside this interpreter.
VLLM_COMMAND = os.path.join(sysconfig.get_path("scripts"), "vllm")


def test_vllm_cli_finds_its_version_where_neuron_is_selected():
    """vllm-cpu's CLI asks for the distribution "vllm" before parsing anything; the neuron
    plugin answers it (Note [The vllm distribution name]). (A process that did not select
    neuron is left alone: test_the_plugin_answers_only_when_the_user_selects_neuron.)"""
    version = subprocess.run([VLLM_COMMAND, "--version"], env=_env("neuron"), capture_output=True, text=True,
                             timeout=300)
    assert version.returncode == 0, version.stderr[-4000:]
    assert version.stdout.strip().splitlines()[-1] == importlib.metadata.version("vllm-cpu") + "+cpu"


def test_vllm_serve_answers_an_openai_completion_with_the_greedy_tokens(checkpoint, tmp_path):
    port = _free_port()
    env = _env("neuron")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # as a user runs it: the engine core in its own process
    log = open(tmp_path / "server.log", "w+")
    server = subprocess.Popen(
        [VLLM_COMMAND, "serve", checkpoint, "--host", "127.0.0.1", "--port",
         str(port), "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes", str(16 << 20),
         "--served-model-name", "tiny"],
        # to a file, not a pipe: nobody reads a pipe while the server runs, and a full one stalls it
        env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while True:  # bounded: the server is up, or the test fails with its output
            if server.poll() is not None:
                pytest.fail(f"the vLLM server exited with {server.returncode}:\n{_stop(server, log)[-6000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the vLLM server did not come up in 300 s:\n{_stop(server, log)[-6000:]}")
            time.sleep(1)
        prompt = _prompts()[1]
        answer = _post(f"http://127.0.0.1:{port}/v1/completions",
                       {"model": "tiny", "prompt": " ".join(f"w{i}" for i in prompt), "max_tokens": MAX_TOKENS,
                        "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        (choice,) = answer["choices"]
        assert choice["prompt_token_ids"] == prompt  # the server's tokenizer read the text
        assert choice["token_ids"] == _hf_greedy(checkpoint)[1]
        assert choice["text"] and answer["usage"]["completion_tokens"] == MAX_TOKENS
        assert "device_config=neuron," in _stop(server, log)  # vLLM's engine config, as it logs it
    finally:
        if server.poll() is None:
            _stop(server, log)
        log.close()
