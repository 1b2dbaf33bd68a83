"""Starting multi-rank jobs (two ranks unless asked) with torchrun on 127.0.0.1, for the distributed tests."""
from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

from subproc import SUBPROCESS_TIMEOUT_S, communicate

REPO = pathlib.Path(__file__).parent.parent
TORCHRUN_TIMEOUT_S = SUBPROCESS_TIMEOUT_S  # two ranks, each importing torch, on a loaded machine


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_command() -> list[str]:
    """The `torchrun` script next to this interpreter; else the module it runs (a venv made
    with --system-site-packages has no script of its own)."""
    script = pathlib.Path(sys.executable).with_name("torchrun")
    return [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]


_TORCHRUN = _torchrun_command()


def torchrun(*args: str, env: dict[str, str] | None = None, nproc: int = 2) -> subprocess.Popen:
    """Start `torchrun --nproc-per-node=NPROC ARGS` on a free port; env's entries are added."""
    port = _free_port()
    full_env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                    GLOO_SOCKET_IFNAME="lo", **(env or {}))  # gloo's pairs on loopback too
    cmd = [*_TORCHRUN, f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={port}", *args]
    return subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> str:
    """Wait for a torchrun job; its stdout, or an AssertionError with both streams."""
    out, err = communicate(proc, TORCHRUN_TIMEOUT_S, what="torchrun")
    if proc.returncode != 0:
        raise AssertionError(f"torchrun exited with {proc.returncode}:\n{out}\n{err}")
    return out
