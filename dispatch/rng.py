"""Replaying a draw: host code that can only draw from torch's default generator, drawing from another.

Random ops on `neuron` draw from torch's default CPU generator in program order (Note [Random
ops draw from CPU's generator] in csrc/runtime/generator.cpp), a deferred one from the copy it
was given at issue (Note [Deferred random ops draw at issue], csrc/aten/generator_lending.cpp).
A backward that must draw its forward's numbers again (attention's dropout mask) lends the
default the state the forward started from with DefaultGeneratorLent.
"""
from __future__ import annotations

import torch


class DefaultGeneratorLent:
    """Inside the block, torch's default CPU generator draws from `generator`'s state; on
    exit the state it reached goes back to `generator` and the default gets its own back.
    For host code that can only use the default generator (a backward replaying its forward's draws)."""

    __slots__ = ("generator", "saved")

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def __enter__(self):
        default = torch.default_generator
        self.saved = default.get_state()
        default.set_state(self.generator.get_state())

    def __exit__(self, *exc):
        default = torch.default_generator
        self.generator.set_state(default.get_state())
        default.set_state(self.saved)
