"""Choosing how ops reach the device: op by op ('eager') or adaptively ('adaptive')."""
from __future__ import annotations

import contextlib

from adaptive_eager.device import settings
from adaptive_eager.dispatch import CONTEXT, EagerExecutor, install_executor

from .engine.executor import AdaptiveExecutor

MODES = ("eager", "adaptive")


class ModeSwitch:
    """Owns the two executors; the engine keeps its traces across switches."""

    def __init__(self):
        self.eager = EagerExecutor()
        self.adaptive = AdaptiveExecutor()

    def get(self) -> str:
        return "adaptive" if CONTEXT.executor is self.adaptive else "eager"

    def set(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; use one of {MODES} (or NEURON_ADAPTIVE_EAGER=0/1)")
        target = self.adaptive if mode == "adaptive" else self.eager
        if CONTEXT.executor is target:
            return
        CONTEXT.executor.synchronize(None)  # nothing held back may outlive its executor
        if CONTEXT.executor is self.adaptive:  # ops reach it through the C++ route while attached
            self.adaptive.detach()
        install_executor(target)
        if target is self.adaptive:
            self.adaptive.attach()

    @staticmethod
    def default_from_env() -> str:
        """NEURON_ADAPTIVE_EAGER's mode. Not silently adaptive on a typo of "0": the settings
        table refuses what is neither mode."""
        return settings.read("NEURON_ADAPTIVE_EAGER")


SWITCH = ModeSwitch()


def set_mode(mode: str) -> None:
    """'adaptive' (the default) fuses repeating op sequences; 'eager' runs op by op."""
    SWITCH.set(mode)


def get_mode() -> str:
    return SWITCH.get()


@contextlib.contextmanager
def mode(name: str):
    """`with adaptive_eager.mode('eager'):` runs a block in that mode, then switches back."""
    previous = get_mode()
    set_mode(name)
    try:
        yield
    finally:
        set_mode(previous)
