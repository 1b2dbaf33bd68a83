"""One vLLM-Omni run in its own process, for tests/clients/test_vllm_omni.py.

vLLM and vLLM-Omni pick their platforms once per process (from VLLM_TARGET_DEVICE), and the
engine's mode is read at import (NEURON_ADAPTIVE_EAGER), so each mode is a process:
`python vllm_omni_child.py '<spec as JSON>'` saves the images to spec["out"] and prints one
line, RESULT_MARKER then a summary as JSON. The pipeline it serves: tiny_sd3.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tiny_sd3 import CALL, MAX_SEQUENCE_LENGTH, WITHOUT_T5

RESULT_MARKER = "@@VLLM_OMNI_RESULT@@"


def _launches() -> int:
    import torch

    import adaptive_eager

    torch.neuron.synchronize()
    return adaptive_eager.stats().launches


def run(spec: dict) -> dict:
    """Serve spec's prompts through vLLM-Omni's diffusion engine (the engine its `Omni` entry
    point runs per stage) with the Diffusers adapter and SDPA attention."""
    import torch
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.diffusion_engine import DiffusionEngine
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams
    from vllm_omni.platforms import current_omni_platform

    config = OmniDiffusionConfig(
        model=spec["model"], dtype=torch.float32, diffusion_load_format="diffusers",
        diffusers_load_kwargs=WITHOUT_T5, diffusers_call_kwargs={"max_sequence_length": MAX_SEQUENCE_LENGTH},
        diffusion_attention_config={"default": {"backend": "TORCH_SDPA"}})
    config.enrich_config()
    engine = DiffusionEngine.make_engine(config)
    images, devices, launches = [], set(), []
    try:
        for i, (prompt, seed) in enumerate(zip(spec["prompts"], spec["seeds"])):
            params = OmniDiffusionSamplingParams(seed=seed, output_type="pt", **CALL)
            before = _launches()
            out = engine.add_req_and_wait_for_response(
                OmniDiffusionRequest(prompt=prompt, sampling_params=params, request_id=f"r{i}"))
            launches.append(_launches() - before)
            assert out.error is None, out.error
            devices.add(out.output.device.type)
            images.append(out.output[0].cpu())
    finally:
        engine.close()
    torch.save(images, spec["out"])
    return {"platform": type(current_omni_platform).__name__, "output_devices": sorted(devices), "launches": launches}


def run_child(spec: dict, env: dict) -> dict:
    """run(spec) in a new process with env: its result, or an AssertionError with its stderr."""
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=900)
    for line in proc.stdout.splitlines():
        marker = line.find(RESULT_MARKER)  # vLLM-Omni prefixes its worker's output lines
        if marker >= 0:
            assert proc.returncode == 0, proc.stderr[-4000:]
            return json.loads(line[marker + len(RESULT_MARKER):])
    raise AssertionError(f"the vLLM-Omni child gave no result (exit {proc.returncode}):\n{proc.stderr[-6000:]}")


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    out = run(spec)
    print(RESULT_MARKER + json.dumps(out), flush=True)
