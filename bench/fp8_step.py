"""The modelled device time of a float8 training step against the same step in bf16, on the
trn2 and trn3 profiles (issue 17): `python bench/fp8_step.py [--dim D --ffn F --tokens T]`.

Two MLP blocks (Linear, GELU, Linear; no bias), bf16 parameters, forward and backward of a
mean-square loss; float8 is torchao's convert_to_float8_training (tensorwise dynamic scaling,
torch._scaled_mm). Each profile runs in its own process (NEURON_PROFILE is read at import).
The figures are the cost model's, the same on every machine; the wall time is not reported.
"matmuls us" is the part of the device time the matmuls take (the op log, device/native.py);
the rest is launch overhead and the other ops (in float8, torchao's scaling and casts).
Needs torchao (the `clients` extra).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

STEPS = 5  # the last one is reported: the engine replays it as one launch by then


def _measure(dim: int, ffn: int, tokens: int) -> dict:
    import warnings

    import torch
    from torch import nn

    import adaptive_eager
    from adaptive_eager.device import native
    from torchao.float8 import convert_to_float8_training

    warnings.filterwarnings("ignore")  # torchao's CUDA extensions, trn2's e4m3fn conversion
    out = {}
    for fp8 in (False, True):
        for mode in ("eager", "adaptive"):
            torch.manual_seed(0)
            model = nn.Sequential(*[nn.Sequential(nn.Linear(dim, ffn, bias=False), nn.GELU(),
                                                  nn.Linear(ffn, dim, bias=False)) for _ in range(2)])
            model = model.to(torch.bfloat16)
            if fp8:
                model = convert_to_float8_training(model)
            model = model.to("neuron")
            x = torch.randn(tokens, dim, dtype=torch.bfloat16, device="neuron")
            with adaptive_eager.mode(mode):
                for step in range(STEPS):
                    adaptive_eager.reset_stats()
                    native.set_op_log(step == STEPS - 1)
                    model(x).float().pow(2).mean().backward()
                    for p in model.parameters():
                        p.grad = None
                    s = adaptive_eager.stats()
            ops = native.take_op_log()
            native.set_op_log(False)
            matmul_us = sum(us for name, us in ops if name in ("aten::mm", "aten::_scaled_mm"))
            out[f"{'fp8' if fp8 else 'bf16'} {mode}"] = (s.device_time_us, s.launches, matmul_us)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_measure(args.dim, args.ffn, args.tokens)))
        return
    print(f"two MLP blocks, dim {args.dim}, ffn {args.ffn}, {args.tokens} tokens, forward and backward")
    print(f"{'profile':<8}{'run':<16}{'device us':>12}{'launches':>10}{'matmuls us':>12}")
    for profile in ("trn2", "trn3"):
        child = subprocess.run([sys.executable, __file__, "--child", f"--dim={args.dim}", f"--ffn={args.ffn}",
                                f"--tokens={args.tokens}"], env={**os.environ, "NEURON_PROFILE": profile},
                               capture_output=True, text=True, check=True)
        results = json.loads(child.stdout.strip().splitlines()[-1])
        for run, (us, launches, matmul_us) in results.items():
            print(f"{profile:<8}{run:<16}{us:>12,.0f}{launches:>10}{matmul_us:>12,.0f}")
        print(f"{profile:<8}{'fp8 / bf16':<16}{results['fp8 adaptive'][0] / results['bf16 adaptive'][0]:>12.2f}  (adaptive)")


if __name__ == "__main__":
    main()
