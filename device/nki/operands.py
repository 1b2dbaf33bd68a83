"""What every instruction does with its operands: checks, reads, writes, PSUM state, pricing.

Shared by the instruction modules (isa.py and the ones it re-exports). Reads give a tile's
values as (partitions, elements per partition), float32 for float dtypes; writes round to the
destination's dtype once (Note [PSUM accumulation] for what a write does to PSUM).
"""
from __future__ import annotations

import torch

from . import costs
from . import dtypes as dt
from . import ops
from .constants import engine, reduce_cmd
from .errors import NkiValidationError
from .program import current
from .tensor import ON_CHIP, PSUM, NkiTensor
from .timeline import Instr


def tile(instr: str, name: str, t, *, buffers=ON_CHIP, max_partitions: int | None = None) -> NkiTensor:
    if not isinstance(t, NkiTensor):
        raise NkiValidationError(f"{instr} {name} must be an NkiTensor, got {type(t).__name__}")
    if t.buffer not in buffers:
        where = " or ".join(f"nl.{b}" for b in buffers)
        raise NkiValidationError(f"{instr} {name} must be in {where}, but tensor {t.name!r} is in nl.{t.buffer}")
    limit = max_partitions or current().target.partitions
    if t.on_chip and t.shape[0] > limit:
        raise NkiValidationError(f"{instr} {name} partition dimension {t.shape[0]} exceeds maximum {limit}")
    if t.on_chip and t.partition_start + t.shape[0] > current().target.partitions:
        raise NkiValidationError(f"{instr} {name} reaches partition {t.partition_start + t.shape[0] - 1}, past the "
                                 f"{current().target.partitions} partitions of the NeuronCore")
    if t.dtype.packed and instr not in ("dma_copy", "memset", "tensor_copy", "nc_matmul_mx", "quantize_mx"):
        raise NkiValidationError(f"{instr} {name}: packed dtype {t.dtype} is only for nc_matmul_mx and quantize_mx")
    return t


def same_layout(instr: str, a_name: str, a: NkiTensor, b_name: str, b: NkiTensor) -> None:
    if a.partitions != b.partitions or a.free_size != b.free_size:
        raise NkiValidationError(
            f"{instr} {a_name} and {b_name} must have the same partition size and elements per partition: "
            f"{a_name} is {a.partitions} x {a.free_size} {a.shape}, {b_name} is {b.partitions} x {b.free_size} {b.shape}")


def two_inputs(instr: str, first: tuple[str, NkiTensor], second: tuple[str, NkiTensor], dst: NkiTensor) -> None:
    """Checks of an instruction reading two tiles element by element into dst: tiles, one
    layout, and not both inputs in PSUM (one of them may be)."""
    (n1, a), (n2, b) = first, second
    for name, t in (first, second, ("dst", dst)):
        tile(instr, name, t)
    same_layout(instr, n1, a, n2, b)
    same_layout(instr, n1, a, "dst", dst)
    if a.buffer == PSUM and b.buffer == PSUM:
        raise NkiValidationError(f"{instr} {n1} and {n2} cannot both be in PSUM")


def column(instr: str, name: str, v, partitions: int):
    """A scalar operand, or a (P, 1) tile broadcast along the free dim: a float or a (P, 1) tensor."""
    if isinstance(v, NkiTensor):
        tile(instr, name, v)
        if v.partitions != partitions or v.free_size != 1:
            raise NkiValidationError(f"{instr} {name} must be a scalar or a ({partitions}, 1) tile, got {v.shape}")
        close_psum(v)
        return read(v).reshape(partitions, 1).to(torch.float32)
    if isinstance(v, (int, float, bool)):
        return float(v)
    raise NkiValidationError(f"{instr} {name} must be a number or a ({partitions}, 1) tile, got {type(v).__name__}")


def read(t: NkiTensor) -> torch.Tensor:
    """The values of a tile as (partitions, elements per partition)."""
    return dt.decode(t.torch_view(), t.dtype).reshape(t.partitions, t.free_size)


def read_f32(t: NkiTensor) -> torch.Tensor:
    return read(t).to(torch.float32)


def write(dst: NkiTensor, values: torch.Tensor) -> None:
    """Round `values` (P, F) to dst's dtype and store them where dst points."""
    view = dst.torch_view()
    if any(s == 0 and n > 1 for s, n in zip(dst.strides, dst.shape)):
        raise NkiValidationError(f"destination {dst.name!r} {dst.shape} is a broadcast view: it cannot be written")
    view.copy_(dt.encode(values, dst.dtype).reshape(dst.shape))
    close_psum(dst)


def copy_bits(dst: NkiTensor, src: NkiTensor) -> None:
    dst.torch_view().copy_(src.torch_view().reshape(src.partitions, -1).reshape(dst.shape))
    close_psum(dst)


def acc_view(t: NkiTensor):
    t.check_extent()
    s = t.storage
    if s.acc is None or t.dtype.itemsize != s.dtype.itemsize:
        return None
    return s.acc.as_strided(t.shape, t.strides, t.offset)


def write_matmul(dst: NkiTensor, product: torch.Tensor, accumulate) -> None:
    """A Tensor Engine result (m, n float32) into its PSUM dst: added to what dst holds if
    `accumulate` is True, or, with accumulate=None, where dst's elements are in an open
    accumulation group (Note [PSUM accumulation]); written over otherwise. Rounded to dst's
    dtype once, after the addition (float32 or, on NeuronCore-v4, bfloat16)."""
    m, n = product.shape
    acc = acc_view(dst)
    if accumulate is None:
        add = acc.reshape(m, n) if acc is not None else torch.zeros(m, n, dtype=torch.bool)
    else:
        add = torch.full((m, n), bool(accumulate))
    result = torch.where(add, read_f32(dst) + product, product)
    dst.torch_view().copy_(dt.encode(result, dst.dtype).reshape(dst.shape))
    if acc is not None:
        acc.fill_(True)


def close_psum(t: NkiTensor) -> None:
    """Note [PSUM accumulation]: a matmul into PSUM with accumulate=None adds to elements a
    matmul wrote and nothing has read or overwritten since (the accumulation group NKI's
    compiler infers: first matmul overwrites, later ones accumulate); any other instruction
    reading or writing those elements closes the group."""
    acc = acc_view(t)
    if acc is not None:
        acc.fill_(False)


def issue(instr: str, eng: str, cost: costs.Cost, reads, writes) -> None:
    current().issue(Instr(instr, eng, cost, [r for r in reads if isinstance(r, NkiTensor)], list(writes)))


def speedup(eng: str, instr: str, dst, *srcs) -> float:
    target = current().target
    if eng == costs.VECTOR:
        return costs.vector_speedup(target, instr, dst, *srcs)
    if eng == costs.SCALAR:
        return costs.scalar_speedup(target, instr, dst, *srcs)
    return 1.0


def choose_engine(instr: str, requested, allowed: tuple[str, ...], default: str) -> str:
    if requested is None or requested == engine.unknown:
        return default
    if not isinstance(requested, engine):
        raise NkiValidationError(f"{instr}: engine={requested!r} is not an nki.isa.engine")
    if requested.name not in allowed:
        raise NkiValidationError(f"{instr} runs on the {', '.join(allowed)} engine(s), not {requested.name}")
    return requested.name


def no_gpsimd_psum(instr: str, eng: str, *tiles) -> None:
    if eng == costs.GPSIMD and any(isinstance(t, NkiTensor) and t.buffer == PSUM for t in tiles):
        raise NkiValidationError(f"{instr} on the GpSimd engine cannot access PSUM (tensor in nl.psum)")


def alu(op: ops.Operator, x, y=None, *, reverse=False):
    if op.arity == 1:
        return op.fn(x)
    if not isinstance(y, torch.Tensor):  # a scalar operand: torch.maximum and friends take tensors only
        y = torch.tensor(y, dtype=x.dtype)
    return op.fn(y, x) if reverse else op.fn(x, y)


def all_int(*tiles) -> bool:
    return all(t.dtype.is_int or t.dtype is dt.bool_ for t in tiles if isinstance(t, NkiTensor))


def bitvec_dtypes(instr: str, *tiles) -> None:
    for t in tiles:
        if not (t.dtype.is_int or t.dtype is dt.bool_):
            raise NkiValidationError(f"{instr} with a bitvec operator needs integer tiles, {t.name!r} is {t.dtype}")


def int_operand(v, p: int):
    if isinstance(v, NkiTensor):
        return read(v).reshape(p, 1).to(torch.int64)
    return int(v or 0)


def accumulate(program, reg: str, instr: str, values: torch.Tensor, reduce_op, cmd, reduce_res, *, init=None,
                negate=False) -> None:
    """An engine's per-partition accumulator registers: reset, reduce into, read out."""
    if not isinstance(cmd, reduce_cmd):
        raise NkiValidationError(f"{instr}: reduce_cmd={cmd!r} is not an nki.isa.reduce_cmd")
    p = values.shape[0]
    op = ops.as_operator(reduce_op, instr=instr, what="reduce_op") if reduce_op is not None else ops.add
    if op.identity is None:
        raise NkiValidationError(f"{instr}: {op!r} is not a reduction operator")
    regs = getattr(program, reg)
    if regs is None or regs.shape[0] != p:
        regs = torch.zeros(p, 1)
    if cmd in (reduce_cmd.reset, reduce_cmd.reset_reduce):
        regs = torch.full((p, 1), float(op.identity))
    elif cmd == reduce_cmd.load_reduce:
        regs = torch.zeros(p, 1) + column(instr, "reduce_init", init, p)
    if cmd in (reduce_cmd.reduce, reduce_cmd.reset_reduce, reduce_cmd.load_reduce):
        regs = op.fn(regs, reduce(op, values, 1, keepdim=True))
    setattr(program, reg, regs)
    if reduce_res is not None:
        tile(instr, "reduce_res", reduce_res)
        if reduce_res.partitions != p or reduce_res.free_size != 1:
            raise NkiValidationError(f"{instr} reduce_res must be a ({p}, 1) tile, got {reduce_res.shape}")
        write(reduce_res, -regs if negate else regs)


def reduce(op: ops.Operator, x: torch.Tensor, dim, keepdim=False) -> torch.Tensor:
    if op is ops.add:
        return x.sum(dim, keepdim=keepdim)
    if op is ops.subtract:
        return -x.sum(dim, keepdim=keepdim)
    if op is ops.multiply:
        dims = (dim,) if isinstance(dim, int) else tuple(dim)
        for d in sorted(dims, reverse=True):
            x = x.prod(d, keepdim=True)
        return x if keepdim else x.squeeze(dims)
    if op is ops.maximum:
        return x.amax(dim, keepdim=keepdim)
    if op is ops.minimum:
        return x.amin(dim, keepdim=keepdim)
    if op in (ops.logical_and, ops.logical_or, ops.logical_xor, ops.bitwise_and, ops.bitwise_or, ops.bitwise_xor):
        dims = (dim,) if isinstance(dim, int) else tuple(dim)
        x = x.movedim(dims, tuple(range(-len(dims), 0))).flatten(-len(dims))
        acc = x[..., 0]
        for i in range(1, x.shape[-1]):
            acc = op.fn(acc, x[..., i])
        return acc.unsqueeze(-1) if keepdim else acc
    raise NkiValidationError(f"{op!r} is not a reduction operator")
