"""The device's random numbers on host code that can only draw from torch's default generator.

Note [RNG order]: random ops on `neuron` draw from the device's generator (csrc/runtime/
generator.cpp), in the order they are issued, whether they run at once (eager mode) or in a
deferred launch (adaptive mode): the launch runs the queue in issue order and each op takes
the generator it was issued with. So both modes draw the same numbers. ATen kernels get the
generator as their argument (`generator=None` is filled in at issue, aten/generator_lending.cpp); host
code that can only draw from torch's default CPU generator (a custom kernel's body, the
math path of attention with dropout) borrows the device generator's state with
DefaultGeneratorLent.
"""
from __future__ import annotations

import torch


class DefaultGeneratorLent:
    """Inside the block, torch's default CPU generator draws from `generator`'s state; on
    exit the state it reached goes back to `generator` and the default gets its own back.
    For host code that can only use the default generator (Note [RNG order])."""

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
