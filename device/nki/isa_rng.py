"""nki.isa's random-number instructions: the engines' per-lane XORWOW generators.

`rand_set_state` seeds, and `rand_get_state` reads, the generator state the GpSimd Engine
(NeuronCore-v3+) and the Vector Engine (NeuronCore-v4+) keep for each of their 128 compute
lanes: XORWOW, 6 uint32 words per generator (the GpSimd Engine has one per lane, the Vector
Engine four: 24 words). `rand2` (NeuronCore-v4+, Vector Engine) draws uniform float32 values
in [min, max] from them. The docs give the algorithm and the state's size, not the order of
the words nor how the engines map draws to elements and to floats, so the values are this
emulator's XORWOW (Marsaglia 2003: words x, y, z, w, v and the Weyl counter d; element j of a
lane drawn by its generator j mod 4 in turn; the top 24 bits of a draw as the float's
fraction): reproducible from a state, never the chip's bits. An unseeded engine starts from a
state made from its lane number, the same every run.
"""
from __future__ import annotations

import torch

from . import costs
from . import dtypes as dt
from . import operands as _op
from .constants import engine
from .errors import NkiValidationError
from .program import current
from .tensor import PSUM, SBUF, NkiTensor

_WORDS = 6  # x, y, z, w, v, d
_GENERATORS = {costs.GPSIMD: 1, costs.VECTOR: 4}
_MASK = 0xFFFFFFFF


def _engine(instr: str, which) -> str:
    """The engine an RNG instruction runs on, checked against the target."""
    v4 = current().target.version >= 4
    if current().target.version < 3:
        raise NkiValidationError(f"{instr} needs NeuronCore-v3 or newer (trn2, trn3)")
    if which in (engine.unknown, None):
        return costs.VECTOR if v4 else costs.GPSIMD
    if which == engine.gpsimd:
        return costs.GPSIMD
    if which == engine.vector and v4:
        return costs.VECTOR
    raise NkiValidationError(f"{instr} runs on the GpSimd Engine{' or the Vector Engine' if v4 else ''} on "
                             f"{current().target.name}, got engine={which!r}")


def _states(eng: str) -> torch.Tensor:
    """The engine's state, (128 lanes, generators * 6) int64 holding uint32 words."""
    program = current()
    states = getattr(program, "rng_states", None)
    if states is None:
        states = program.rng_states = {}
    if eng not in states:
        n = _GENERATORS[eng] * _WORDS
        lanes = torch.arange(128, dtype=torch.int64).reshape(128, 1)
        words = torch.arange(n, dtype=torch.int64).reshape(1, n)
        # any state but all-zero x..v works; Marsaglia's seeds, moved per lane and word
        states[eng] = (lanes * 2654435761 + words * 40503 + 123456789) & _MASK
    return states[eng]


def _check_state_tile(instr: str, name: str, t: NkiTensor, eng: str) -> None:
    _op.tile(instr, name, t, buffers=(SBUF,) if eng == costs.GPSIMD else (SBUF, PSUM))
    if t.dtype != dt.uint32:
        raise NkiValidationError(f"{instr} {name} must be uint32, got {t.dtype}")
    words = _GENERATORS[eng] * _WORDS
    if t.free_size != words:
        raise NkiValidationError(f"{instr} {name} holds {words} XORWOW words per lane on the "
                                 f"{'GpSimd' if eng == costs.GPSIMD else 'Vector'} Engine, got {t.free_size}")


def rand_set_state(src_seeds: NkiTensor, engine=engine.unknown, name=None):
    """Seed each lane's generators from its partition of src_seeds (uint32, 6 or 24 words)."""
    eng = _engine("rand_set_state", engine)
    _check_state_tile("rand_set_state", "src_seeds", src_seeds, eng)
    _op.close_psum(src_seeds)
    state = _states(eng)
    p = src_seeds.partitions
    state[:p] = src_seeds.torch_view().reshape(p, -1).to(torch.int64) & _MASK  # the bits, not float32 values
    _op.issue("rand_set_state", eng, costs.alu(current().target, eng, src_seeds.free_size), [src_seeds], [])


def rand_get_state(dst: NkiTensor, engine=engine.unknown, name=None):
    """Store each lane's generator state into its partition of dst (uint32, 6 or 24 words)."""
    eng = _engine("rand_get_state", engine)
    _check_state_tile("rand_get_state", "dst", dst, eng)
    _op.write(dst, _states(eng)[:dst.partitions].clone())
    _op.issue("rand_get_state", eng, costs.alu(current().target, eng, dst.free_size), [], [dst])


def _xorwow(state: torch.Tensor, g: int) -> torch.Tensor:
    """One draw of generator g of every lane (state updated in place): uint32 as int64."""
    base = g * _WORDS
    x, v, d = state[:, base], state[:, base + 4], state[:, base + 5]
    t = (x ^ (x >> 2)) & _MASK
    state[:, base:base + 4] = state[:, base + 1:base + 5].clone()
    v = (v ^ ((v << 4) & _MASK) ^ t ^ ((t << 1) & _MASK)) & _MASK
    d = (d + 362437) & _MASK
    state[:, base + 4], state[:, base + 5] = v, d
    return (v + d) & _MASK


def rand2(dst: NkiTensor, min, max, name=None):  # noqa: A002 (NKI's names)
    """Uniform float32 values in [min, max] (scalars or (P, 1) columns) from the Vector Engine's
    generators, converted to dst's dtype."""
    instr = "rand2"
    if current().target.version < 4:
        raise NkiValidationError(f"{instr} is available only on NeuronCore-v4 and newer (trn3); the target is "
                                 f"{current().target.name}")
    _op.tile(instr, "dst", dst, buffers=(SBUF, PSUM))
    p, n = dst.partitions, dst.free_size
    lo, hi = _op.column(instr, "min", min, p), _op.column(instr, "max", max, p)
    lo_t, hi_t = torch.as_tensor(lo, dtype=torch.float32), torch.as_tensor(hi, dtype=torch.float32)
    if bool((lo_t >= hi_t).any()):
        raise NkiValidationError(f"{instr}: min must be less than max, got min={min!r} max={max!r}")
    lanes = _states(costs.VECTOR)[:p]  # a view: the lanes that draw move on
    draws = torch.empty(p, n, dtype=torch.int64)
    for j in range(n):
        draws[:, j] = _xorwow(lanes, j % _GENERATORS[costs.VECTOR])
    unit = (draws >> 8).to(torch.float32) * (1.0 / (1 << 24))  # [0, 1) in float32's 24 bits
    _op.write(dst, lo_t + unit * (hi_t - lo_t))
    _op.issue(instr, costs.VECTOR, costs.alu(current().target, costs.VECTOR, n), [min, max], [dst])
