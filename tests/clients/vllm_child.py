"""One vLLM run in its own process, for tests/clients/test_vllm.py and bench/vllm_decode.py.

vLLM picks its platform once per process (at the first `vllm.platforms.current_platform`),
from VLLM_TARGET_DEVICE, and the engine's mode is read at import (NEURON_ADAPTIVE_EAGER), so
each platform and mode is a process: `python vllm_child.py '<spec as JSON>'` prints one line,
RESULT_MARKER then the result as JSON. Also `write_tiny_llama(path)`: the checkpoint, random
weights and a word-level tokenizer (`w3` ... `w511`), written locally (nothing downloaded).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

RESULT_MARKER = "@@VLLM_RESULT@@"
VOCAB = 512


def write_tiny_llama(path: str) -> str:
    """A 2-layer Llama with grouped-query attention (2 query heads, 1 KV head, head_dim 64)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    # Special tokens are matched in the raw text before words are split: none may be a word's
    # prefix (an eos token "w2" made "w255" two tokens).
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                                         eos_token="</s>").save_pretrained(path)
    return path


class _StepCounter:
    """The launches and device time of each model-runner step, from one step's start to the
    next's (the step's host read of its sampled tokens included), while it is installed."""

    def __init__(self, runner, wait: bool):
        self.runner, self.wait = runner, wait
        self.marks = []  # (a prefill step: new requests in it, launches, device us) at each step's start

    def _mark(self, prefill: bool) -> None:
        import adaptive_eager

        s = adaptive_eager.stats(wait=self.wait)
        self.marks.append((prefill, s.launches, s.device_time_us))

    def __enter__(self):
        execute = self.execute = self.runner.execute_model

        def counted(scheduler_output, *args, **kwargs):
            self._mark(bool(scheduler_output.scheduled_new_reqs))
            return execute(scheduler_output, *args, **kwargs)

        self.runner.execute_model = counted
        return self

    def __exit__(self, *exc):
        self.runner.execute_model = self.execute
        self._mark(False)

    def steps(self, prefill: bool) -> list[tuple[int, float]]:
        """(launches, device us) of the prefill steps, or of the others."""
        return [(b[1] - a[1], b[2] - a[2]) for a, b in zip(self.marks, self.marks[1:]) if a[0] == prefill]


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    llm = LLM(model=spec["model"], dtype="float32", max_model_len=256, max_num_seqs=8, seed=0,
              kv_cache_memory_bytes=16 << 20)
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    n = spec["max_tokens"]

    def generate(params):
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    greedy = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    result = {"platform": type(current_platform).__name__, "greedy": generate(greedy)}
    sampled = [SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=seed, max_tokens=n, ignore_eos=True)
               for seed in spec.get("seeds", ())]
    if sampled:
        result["sampled"] = [generate(p) for p in sampled]
        result["sampled_again"] = [generate(p) for p in sampled]
    if current_platform.device_type == "neuron":
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        result["parameter_devices"] = sorted({p.device.type for p in runner.model.parameters()})
        result["kv_cache_devices"] = sorted({t.device.type for t in runner.kv_caches})
        result["attention_backends"] = sorted({type(layer.impl).__name__
                                               for layer in runner.model.modules() if hasattr(layer, "impl")})
        # Decode cost: each step of a call counted (after a warm-up call), one token for every request.
        decode = spec.get("decode", 0)
        if decode:
            generate(SamplingParams(temperature=0.0, max_tokens=decode + 1, ignore_eos=True))  # warm-up
            with _StepCounter(runner, wait=True) as counter:
                generate(SamplingParams(temperature=0.0, max_tokens=decode + 1, ignore_eos=True))
            (result["prefill_launches"], _), = counter.steps(prefill=True)
            decoded = counter.steps(prefill=False)
            assert len(decoded) == decode, f"{len(decoded)} decode steps, expected {decode}"
            result["decode_launches_per_step"] = sum(n for n, _ in decoded) / decode
            result["decode_device_us_per_step"] = sum(us for _, us in decoded) / decode
        calls = spec.get("serve_calls", 0)
        if calls:
            result.update(_serve(llm, runner, spec["prompts"], calls, decode + 1))
    return result


def _serve(llm, runner, prompts: list[list[int]], calls: int, max_tokens: int) -> dict:
    """As a server sees them: `calls` batches of new requests, each of the prompts' lengths
    (new token ids), each decoded `max_tokens` tokens. The launches of each step, counted from
    one model-runner step to the next (the step's host read of its sampled tokens included)."""
    import torch
    from vllm import SamplingParams

    g = torch.Generator().manual_seed(7)
    tokens = []
    with _StepCounter(runner, wait=False) as counter:
        for _ in range(calls):
            batch = [{"prompt_token_ids": torch.randint(3, 512, (len(ids),), generator=g).tolist()} for ids in prompts]
            outs = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                                use_tqdm=False)
            tokens.append([list(o.outputs[0].token_ids) for o in outs])
    return {"serve_tokens": tokens,
            "serve_prefill_launches": [n for n, _ in counter.steps(prefill=True)],
            "serve_decode_launches": [n for n, _ in counter.steps(prefill=False)]}


def run_child(spec: dict, env: dict) -> dict:
    """run(spec) in a new process with env: its result, or an AssertionError with its stderr."""
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=900)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_MARKER):
            assert proc.returncode == 0, proc.stderr[-4000:]
            return json.loads(line[len(RESULT_MARKER):])
    raise AssertionError(f"the vLLM child gave no result (exit {proc.returncode}):\n{proc.stderr[-6000:]}")


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    out = run(spec)
    print(RESULT_MARKER + json.dumps(out), flush=True)
