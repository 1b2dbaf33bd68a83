"""nki.isa's sequential and accumulating instructions: scans along the free dim, cumulative
tensor-scalar ops, the exponential with a running sum, predicated selection with a max
reduction, and reductions across partitions."""
from __future__ import annotations

import torch

from . import costs
from . import ops
from .constants import reduce_cmd
from .errors import NkiValidationError
from .operands import (accumulate, alu, close_psum, column, issue, read, read_f32, reduce, same_layout, tile,
                       two_inputs, write)
from .program import current
from .tensor import SBUF, NkiTensor


def _arith(instr: str, what: str, op) -> ops.Operator:
    op = ops.as_operator(op, instr=instr, what=what)
    if op.kind == ops.BITVEC or op.arity != 2:
        raise NkiValidationError(f"{instr} {what} must be a binary arithmetic operator, got {op!r}")
    return op


def tensor_tensor_scan(dst: NkiTensor, data0: NkiTensor, data1: NkiTensor, initial, op0, op1, reverse0=False,
                       reverse1=False, name=None):
    """Per partition: r[0] = op1(op0(data0[0], initial), data1[0]),
    r[i] = op1(op0(data0[i], r[i-1]), data1[i]), over the flattened free dims, in float32."""
    two_inputs("tensor_tensor_scan", ("data0", data0), ("data1", data1), dst)
    o0, o1 = _arith("tensor_tensor_scan", "op0", op0), _arith("tensor_tensor_scan", "op1", op1)
    p = data0.partitions
    state = column("tensor_tensor_scan", "initial", initial, p)
    state = state.reshape(p) if isinstance(state, torch.Tensor) else torch.full((p,), state)
    close_psum(data0), close_psum(data1)
    a, b = read_f32(data0), read_f32(data1)
    out = torch.empty_like(a)
    for i in range(a.shape[1]):  # sequential by definition: each element depends on the one before
        state = alu(o1, alu(o0, a[:, i], state, reverse=reverse0), b[:, i], reverse=reverse1)
        out[:, i] = state
    write(dst, out)
    issue("tensor_tensor_scan", costs.VECTOR, costs.alu(current().target, costs.VECTOR, dst.free_size, 2),
          [data0, data1, initial], [dst])


def tensor_scalar_cumulative(dst: NkiTensor, src: NkiTensor, op0, op1, imm0, imm1=None,
                             reduce_cmd=reduce_cmd.reset_reduce, name=None):
    """reg = op1(op0(src[i], imm0), reg); dst[i] = reg, the register set by reduce_cmd."""
    tile("tensor_scalar_cumulative", "src", src)
    tile("tensor_scalar_cumulative", "dst", dst)
    same_layout("tensor_scalar_cumulative", "src", src, "dst", dst)
    o0 = _arith("tensor_scalar_cumulative", "op0", op0)
    o1 = _arith("tensor_scalar_cumulative", "op1", op1)
    if o1 not in (ops.add, ops.subtract, ops.multiply, ops.maximum, ops.minimum):
        raise NkiValidationError(f"tensor_scalar_cumulative op1 must be add, subtract, multiply, maximum or minimum, "
                                 f"got {o1!r}")
    program, p = current(), src.partitions
    if reduce_cmd == reduce_cmd.reset_reduce:
        reg = torch.full((p,), float(o1.identity))
    elif reduce_cmd == reduce_cmd.load_reduce:
        v = column("tensor_scalar_cumulative", "imm1", imm1, p)
        reg = v.reshape(p) if isinstance(v, torch.Tensor) else torch.full((p,), v)
    elif reduce_cmd == reduce_cmd.reduce:
        reg = program.vector_acc.reshape(p) if program.vector_acc is not None else torch.zeros(p)
    else:
        raise NkiValidationError(f"tensor_scalar_cumulative reduce_cmd must be reset_reduce, reduce or load_reduce, "
                                 f"got {reduce_cmd}")
    scalar = column("tensor_scalar_cumulative", "imm0", imm0, p)
    scalar = scalar.reshape(p) if isinstance(scalar, torch.Tensor) else scalar
    close_psum(src)
    x = read_f32(src)
    out = torch.empty_like(x)
    for i in range(x.shape[1]):
        reg = o1.fn(o0.fn(x[:, i], torch.as_tensor(scalar)), reg)
        out[:, i] = reg
    program.vector_acc = reg.reshape(p, 1)
    write(dst, out)
    issue("tensor_scalar_cumulative", costs.VECTOR, costs.alu(current().target, costs.VECTOR, dst.free_size),
          [src, imm0, imm1], [dst])


def exponential(dst: NkiTensor, src: NkiTensor, max_value=0.0, reduce_res=None, reduce_cmd=reduce_cmd.idle,
                reduce_init=0.0, name=None):
    """exp(src - max_value) on the Vector Engine (NeuronCore-v4), summing into its accumulators."""
    if current().target.version < 4:
        raise NkiValidationError("exponential is available on NeuronCore-v4 (trn3) and newer; use "
                                 "nisa.activation(op=nl.exp, bias=-max) on the Scalar Engine")
    tile("exponential", "src", src)
    tile("exponential", "dst", dst)
    same_layout("exponential", "src", src, "dst", dst)
    close_psum(src)
    out = torch.exp(read_f32(src) - column("exponential", "max_value", max_value, src.partitions))
    write(dst, out)
    accumulate(current(), "vector_acc", "exponential", out, ops.add, reduce_cmd, reduce_res, init=reduce_init)
    # "4x the throughput compared to ... activation (op=nl.exp)" (trainium3_arch.rst:179)
    issue("exponential", costs.VECTOR, costs.alu(current().target, costs.VECTOR, src.free_size, speedup=4.0),
          [src, max_value], [dst] + ([reduce_res] if reduce_res is not None else []))


def select_reduce(dst: NkiTensor, predicate: NkiTensor, on_true: NkiTensor, on_false, reduce_res=None,
                  reduce_cmd=reduce_cmd.idle, reduce_op=ops.maximum, reverse_pred=False, name=None):
    """where(predicate, on_true, on_false), and optionally its row max into the accumulators."""
    two_inputs("select_reduce", ("on_true", on_true), ("predicate", predicate), dst)
    if not predicate.dtype.is_int:
        raise NkiValidationError(f"select_reduce predicate must be an integer tile, got {predicate.dtype}")
    if ops.as_operator(reduce_op, instr="select_reduce", what="reduce_op") is not ops.maximum:
        raise NkiValidationError("select_reduce supports only reduce_op=nl.maximum")
    mask = read(predicate) != 0
    if reverse_pred:
        mask = ~mask
    close_psum(on_true)
    out = torch.where(mask, read_f32(on_true), column("select_reduce", "on_false", on_false, on_true.partitions))
    write(dst, out)
    if reduce_cmd != reduce_cmd.idle or reduce_res is not None:
        accumulate(current(), "vector_acc", "select_reduce", out, ops.maximum, reduce_cmd, reduce_res)
    issue("select_reduce", costs.VECTOR, costs.alu(current().target, costs.VECTOR, dst.free_size, 2),
          [predicate, on_true, on_false], [dst] + ([reduce_res] if reduce_res is not None else []))


def tensor_partition_reduce(dst: NkiTensor, op, data: NkiTensor, name=None):
    """Reduce across partitions (add, average, maximum, bitwise_or, bitwise_and) on the GpSimd
    Engine: dst has one partition and data's elements per partition."""
    tile("tensor_partition_reduce", "data", data, buffers=(SBUF,))
    tile("tensor_partition_reduce", "dst", dst, buffers=(SBUF,))
    if dst.partitions != 1 or dst.free_size != data.free_size:
        raise NkiValidationError(f"tensor_partition_reduce dst must be (1, {data.free_size}), got {dst.shape}")
    if op == "average":
        write(dst, read_f32(data).mean(0, keepdim=True))
    else:
        op = ops.as_operator(op, instr="tensor_partition_reduce")
        if op not in (ops.add, ops.maximum, ops.bitwise_or, ops.bitwise_and):
            raise NkiValidationError(f"tensor_partition_reduce op must be add, average, maximum, bitwise_or or "
                                     f"bitwise_and, got {op!r}")
        x = read(data).to(torch.int64) if op.kind == ops.BITVEC else read_f32(data)
        write(dst, reduce(op, x, 0, keepdim=True))
    issue("tensor_partition_reduce", costs.GPSIMD,
          costs.alu(current().target, costs.GPSIMD, data.free_size * data.partitions // 16), [data], [dst])
