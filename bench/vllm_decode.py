"""Launches and modelled device time per decode step of vLLM serving on neuron, eager against
adaptive (issue 18): `python bench/vllm_decode.py [--requests N --decode STEPS]`.

A tiny random Llama (tests/clients/vllm_child.py writes it: 2 layers, GQA, head_dim 64, fp32),
N prompts of different lengths, greedy; each mode runs in its own process. A decode step makes
one token for every request, so per step is per N tokens. The figures are the cost model's and
the engine's counts, the same on every machine; wall time is not reported. Needs the `vllm`
extra (README, "Serving with vLLM").
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

CLIENTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests", "clients")
sys.path.insert(0, CLIENTS)
from vllm_child import run_child, write_tiny_llama  # noqa: E402


def _run(spec: dict, adaptive: bool) -> dict:
    env = {**os.environ, "VLLM_TARGET_DEVICE": "neuron", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "NEURON_ADAPTIVE_EAGER": "1" if adaptive else "0", "VLLM_NO_USAGE_STATS": "1"}
    return run_child(spec, env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--decode", type=int, default=32, help="decode steps measured")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_llama(tmp)
        prompts = [[3 + (7 * i + j) % 500 for j in range(1 + 9 * i)] for i in range(args.requests)]
        spec = {"model": model, "prompts": prompts, "max_tokens": 2, "decode": args.decode}
        print(f"vLLM decode on neuron, {args.requests} requests (prompts of {min(map(len, prompts))} to "
              f"{max(map(len, prompts))} tokens), {args.decode} steps measured")
        print(f"{'mode':<10}{'launches/step':>15}{'device us/step':>16}{'prefill launches':>18}")
        for adaptive in (False, True):
            r = _run(spec, adaptive)
            print(f"{'adaptive' if adaptive else 'eager':<10}{r['decode_launches_per_step']:>15.1f}"
                  f"{r['decode_device_us_per_step']:>16.1f}{r['prefill_launches']:>18}")


if __name__ == "__main__":
    main()
