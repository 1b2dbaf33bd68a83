"""nki.isa's element-wise, activation, reduction, pattern and statistics instructions of the
Vector, Scalar and GpSimd Engines (arithmetic in float32, rounded once to dst's dtype)."""
from __future__ import annotations

import math

import torch

from . import costs
from . import dtypes as dt
from . import operands as _op
from . import ops
from . import constants
from .constants import engine, reduce_cmd
from .errors import NkiValidationError
from .program import current
from .tensor import PSUM, SBUF, NkiTensor


# --- Vector / Scalar / GpSimd: element-wise ------------------------------------------------------------
def tensor_tensor(dst: NkiTensor, data1: NkiTensor, data2: NkiTensor, op, engine=engine.unknown, name=None):
    op = ops.as_operator(op, instr="tensor_tensor")
    _op.two_inputs("tensor_tensor", ("data1", data1), ("data2", data2), dst)
    if op.arity != 2:
        raise NkiValidationError(f"tensor_tensor needs a binary operator, got {op!r}")
    native_int = _op.all_int(dst, data1, data2) and all(t.dtype in (dt.int32, dt.uint32) for t in (dst, data1, data2))
    default = costs.GPSIMD if (op is ops.power or native_int) and not any(
        t.buffer == PSUM for t in (dst, data1, data2)) else costs.VECTOR
    eng = _op.choose_engine("tensor_tensor", engine, (costs.VECTOR, costs.GPSIMD), default)
    _op.no_gpsimd_psum("tensor_tensor", eng, dst, data1, data2)
    _op.close_psum(data1), _op.close_psum(data2)
    if op.kind == ops.BITVEC:
        _op.bitvec_dtypes("tensor_tensor", dst, data1, data2)
        result = op.fn(_op.read(data1).to(torch.int64), _op.read(data2).to(torch.int64))
    elif native_int and eng == costs.GPSIMD:
        result = op.fn(_op.read(data1).to(torch.int64), _op.read(data2).to(torch.int64))
    else:
        result = op.fn(_op.read_f32(data1), _op.read_f32(data2))
    _op.write(dst, result)
    _op.issue("tensor_tensor", eng, costs.alu(current().target, eng, dst.free_size, 2,
                                           _op.speedup(eng, "tensor_tensor", dst, data1, data2)), [data1, data2], [dst])


def tensor_scalar(dst: NkiTensor, data: NkiTensor, op0, operand0, reverse0=False, op1=None, operand1=None,
                  reverse1=False, engine=engine.unknown, name=None):
    _op.tile("tensor_scalar", "dst", dst)
    _op.tile("tensor_scalar", "data", data)
    _op.same_layout("tensor_scalar", "data", data, "dst", dst)
    op0 = ops.as_operator(op0, instr="tensor_scalar", what="op0")
    op1 = ops.as_operator(op1, instr="tensor_scalar", what="op1") if op1 is not None else None
    if op1 is None and operand1 is not None:
        raise NkiValidationError("tensor_scalar: operand1 given without op1")
    if op1 is not None and (op0.kind == ops.BITVEC) != (op1.kind == ops.BITVEC):
        raise NkiValidationError(f"tensor_scalar op0 {op0!r} and op1 {op1!r} must both be bitvec or both arithmetic")
    eng = _op.choose_engine("tensor_scalar", engine, (costs.VECTOR, costs.SCALAR, costs.GPSIMD), costs.VECTOR)
    _op.no_gpsimd_psum("tensor_scalar", eng, dst, data, operand0, operand1)
    p = data.partitions
    _op.close_psum(data)
    if op0.kind == ops.BITVEC:
        _op.bitvec_dtypes("tensor_scalar", dst, data)
        x = _op.read(data).to(torch.int64)
        x = _op.alu(op0, x, _op.int_operand(operand0, p), reverse=reverse0)
        if op1 is not None:
            x = _op.alu(op1, x, _op.int_operand(operand1, p), reverse=reverse1)
    else:
        x = _op.read_f32(data)
        x = _op.alu(op0, x, _op.column("tensor_scalar", "operand0", 0.0 if operand0 is None else operand0, p), reverse=reverse0)
        if op1 is not None:
            x = _op.alu(op1, x, _op.column("tensor_scalar", "operand1", 0.0 if operand1 is None else operand1, p),
                     reverse=reverse1)
    _op.write(dst, x)
    _op.issue("tensor_scalar", eng, costs.alu(current().target, eng, dst.free_size, 1, _op.speedup(eng, "tensor_scalar", dst, data)),
           [data, operand0, operand1], [dst])


def scalar_tensor_tensor(dst: NkiTensor, data: NkiTensor, op0, operand0, op1, operand1: NkiTensor, reverse0=False,
                         reverse1=False, name=None):
    _op.two_inputs("scalar_tensor_tensor", ("data", data), ("operand1", operand1), dst)
    op0 = ops.as_operator(op0, instr="scalar_tensor_tensor", what="op0")
    op1 = ops.as_operator(op1, instr="scalar_tensor_tensor", what="op1")
    if ops.BITVEC in (op0.kind, op1.kind):
        raise NkiValidationError("scalar_tensor_tensor takes arithmetic operators only")
    _op.close_psum(data), _op.close_psum(operand1)
    x = _op.alu(op0, _op.read_f32(data), _op.column("scalar_tensor_tensor", "operand0", operand0, data.partitions),
             reverse=reverse0)
    x = _op.alu(op1, x, _op.read_f32(operand1), reverse=reverse1)
    _op.write(dst, x)
    _op.issue("scalar_tensor_tensor", costs.VECTOR, costs.alu(current().target, costs.VECTOR, dst.free_size, 2),
           [data, operand0, operand1], [dst])


def reciprocal(dst: NkiTensor, data: NkiTensor, name=None):
    _op.tile("reciprocal", "dst", dst)
    _op.tile("reciprocal", "data", data)
    _op.same_layout("reciprocal", "data", data, "dst", dst)
    _op.close_psum(data)
    _op.write(dst, torch.reciprocal(_op.read_f32(data)))
    # Vector Engine reciprocal: about 8 cycles per element (the NKI API docs' engine selection table)
    _op.issue("reciprocal", costs.VECTOR, costs.alu(current().target, costs.VECTOR, 8 * data.free_size), [data], [dst])


def activation(dst: NkiTensor, op, data: NkiTensor, bias=None, scale=1.0, reduce_op=None, reduce_res=None,
               reduce_cmd=reduce_cmd.idle, name=None):
    out = _activate("activation", dst, op, data, bias, scale, reduce_res)
    _op.accumulate(current(), "scalar_acc", "activation", out, reduce_op, reduce_cmd, reduce_res)


def activation_reduce(dst: NkiTensor, op, data: NkiTensor, reduce_op, reduce_res: NkiTensor, bias=None, scale=1.0,
                      name=None):
    out = _activate("activation_reduce", dst, op, data, bias, scale, reduce_res)
    _op.accumulate(current(), "scalar_acc", "activation_reduce", out, reduce_op, reduce_cmd.reset_reduce, reduce_res)


# activate2's tensor-scalar stage: the (op0, op1) pairs the NKI docs list (None is nl.bypass)
_ACTIVATE2_STAGES = {("multiply", "add"), ("multiply", "subtract"), ("multiply", None), ("add", None),
                     ("subtract", None), (None, None)}


def activate2(dst: NkiTensor, op, data: NkiTensor, imm0, imm1, op0, op1, relu_param=0.0, reverse0=False,
              reverse1=False, reduce_op=None, reduce_res=None, reduce_cmd=reduce_cmd.idle, engine=engine.scalar,
              name=None):
    """NeuronCore-v4's activation: (data op0 imm0) op1 imm1 in float32, then the activation
    function `op` (prelu's negative slope is relu_param), then the Scalar Engine's optional
    accumulation, as nki.isa.activation's."""
    instr = "activate2"
    if current().target.version < 4:
        raise NkiValidationError(f"{instr} is available only on NeuronCore-v4 and newer (trn3); the target is "
                                 f"{current().target.name}: use nisa.activation with scale and bias")
    # (the argument shadows the enum) the Scalar Engine, or on NeuronCore-v4 the GpSIMD Engine
    # without the accumulation (Neuron SDK 2.33's signature)
    if engine in (constants.engine.scalar, constants.engine.unknown):
        eng = costs.SCALAR
    elif engine == constants.engine.gpsimd:
        eng = costs.GPSIMD
        if reduce_res is not None or reduce_cmd != constants.reduce_cmd.idle:
            raise NkiValidationError(f"{instr}: the accumulation (reduce_res, reduce_cmd) is the Scalar Engine's only")
    else:
        raise NkiValidationError(f"{instr} runs on the Scalar or the GpSIMD Engine, got engine={engine!r}")
    names = tuple(None if o is None else ops.as_operator(o, instr=instr, what=w).name
                  for o, w in ((op0, "op0"), (op1, "op1")))
    if names not in _ACTIVATE2_STAGES:
        raise NkiValidationError(f"{instr}: (op0, op1) = {names} is not a tensor-scalar stage it has; it takes "
                                 f"(multiply, add), (multiply, subtract), (multiply, bypass), (add, bypass), "
                                 f"(subtract, bypass) or (bypass, bypass)")
    if (reverse0 and op0 is None) or (reverse1 and op1 is None):
        raise NkiValidationError(f"{instr}: reverse0 needs op0 and reverse1 needs op1 (not nl.bypass)")
    if isinstance(imm0, NkiTensor) and isinstance(imm1, NkiTensor) and imm0.dtype != imm1.dtype:
        raise NkiValidationError(f"{instr}: imm0 and imm1 must have one dtype, got {imm0.dtype} and {imm1.dtype}")
    act = _activation_function(instr, dst, op, data)
    p = data.partitions
    _op.close_psum(data)
    x = _op.read_f32(data)
    for operator, imm, reverse, what in ((op0, imm0, reverse0, "imm0"), (op1, imm1, reverse1, "imm1")):
        if operator is not None:
            x = _op.alu(ops.as_operator(operator, instr=instr), x, _op.column(instr, what, imm, p), reverse=reverse)
    if act is ops.prelu:
        out = torch.where(x >= 0, x, x * _op.column(instr, "relu_param", relu_param, p))
    else:
        out = act.fn(x)
    _op.write(dst, out)
    extra = costs.ACC_READ_CYCLES if reduce_res is not None else 0
    _op.issue(instr, eng, costs.alu(current().target, eng, data.free_size, extra_cycles=extra),
              [data, imm0, imm1, relu_param], [dst] + ([reduce_res] if reduce_res is not None else []))
    if eng == costs.SCALAR:
        _op.accumulate(current(), "scalar_acc", instr, out, reduce_op, reduce_cmd, reduce_res)


def _activation_function(instr: str, dst, op, data) -> ops.Operator:
    """The activation an instruction applies, its tiles checked as every activation checks them."""
    _op.tile(instr, "dst", dst)
    _op.tile(instr, "data", data)
    _op.same_layout(instr, "data", data, "dst", dst)
    op = ops.as_operator(op, instr=instr)
    if not op.activation:
        raise NkiValidationError(f"{instr}: {op!r} is not an activation function of the Scalar Engine "
                                 f"(see the NKI docs' 'Supported Activation Functions')")
    return op


def _activate(instr: str, dst, op, data, bias, scale, read_out) -> torch.Tensor:
    op = _activation_function(instr, dst, op, data)
    p = data.partitions
    if isinstance(scale, NkiTensor) and scale.dtype != dt.float32:
        raise NkiValidationError(f"{instr} scale must be float32, got {scale.dtype}")
    _op.close_psum(data)
    x = _op.read_f32(data) * _op.column(instr, "scale", scale, p)
    if bias is not None:
        x = x + _op.column(instr, "bias", bias, p)
    out = op.fn(x)
    _op.write(dst, out)
    # reading the accumulators out into reduce_res is one more short instruction
    extra = costs.ACC_READ_CYCLES if read_out else 0
    _op.issue(instr, costs.SCALAR, costs.alu(current().target, costs.SCALAR, data.free_size, extra_cycles=extra),
           [data, bias, scale], [dst] + ([read_out] if read_out is not None else []))
    return out


def tensor_reduce(dst: NkiTensor, op, data: NkiTensor, axis, negate=False, keepdims=False, name=None):
    _op.tile("tensor_reduce", "dst", dst)
    _op.tile("tensor_reduce", "data", data)
    op = ops.as_operator(op, instr="tensor_reduce")
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    axes = tuple(sorted(a % data.ndim for a in axes))
    if 0 in axes:
        raise NkiValidationError("tensor_reduce cannot reduce axis 0, the partition axis (use nc_transpose first, or "
                                 "nc_matmul with a ones vector)")
    if axes != tuple(range(data.ndim - len(axes), data.ndim)):
        raise NkiValidationError(f"tensor_reduce axis {axis}: the reduced axes must be the last contiguous free "
                                 f"dims ending at the final one, e.g. {tuple(range(data.ndim - len(axes), data.ndim))}")
    kept = math.prod(data.shape[1:data.ndim - len(axes)])
    if dst.partitions != data.partitions or dst.free_size != kept:
        raise NkiValidationError(f"tensor_reduce of {data.shape} over axes {axes} gives {data.partitions} x {kept}, "
                                 f"dst is {dst.partitions} x {dst.free_size} {dst.shape}")
    _op.close_psum(data)
    if op.kind == ops.BITVEC:
        _op.bitvec_dtypes("tensor_reduce", dst, data)
        x = dt.decode(data.torch_view(), data.dtype).to(torch.int64)
    else:
        x = dt.decode(data.torch_view(), data.dtype).to(torch.float32)
    r = _op.reduce(op, x, axes).reshape(data.partitions, kept)
    if negate:
        if op.kind == ops.BITVEC:
            raise NkiValidationError("tensor_reduce negate applies to arithmetic operators only")
        r = -r
    _op.write(dst, r)
    _op.issue("tensor_reduce", costs.VECTOR, costs.alu(current().target, costs.VECTOR, data.free_size), [data], [dst])


def tensor_scalar_reduce(dst: NkiTensor, data: NkiTensor, op0, operand0, reduce_op, reduce_res=None, reverse0=False,
                         reduce_cmd=reduce_cmd.reset_reduce, reduce_init=None, reduce_res_negate=False, name=None):
    _op.tile("tensor_scalar_reduce", "dst", dst)
    _op.tile("tensor_scalar_reduce", "data", data)
    _op.same_layout("tensor_scalar_reduce", "data", data, "dst", dst)
    op0 = ops.as_operator(op0, instr="tensor_scalar_reduce", what="op0")
    if op0.kind == ops.BITVEC:
        raise NkiValidationError("tensor_scalar_reduce takes an arithmetic op0 only")
    _op.close_psum(data)
    x = _op.alu(op0, _op.read_f32(data), _op.column("tensor_scalar_reduce", "operand0", 0.0 if operand0 is None else operand0,
                                           data.partitions), reverse=reverse0)
    _op.write(dst, x)
    _op.accumulate(current(), "vector_acc", "tensor_scalar_reduce", x, reduce_op, reduce_cmd, reduce_res,
                init=reduce_init, negate=reduce_res_negate)
    _op.issue("tensor_scalar_reduce", costs.VECTOR, costs.alu(current().target, costs.VECTOR, data.free_size),
           [data, operand0], [dst] + ([reduce_res] if reduce_res is not None else []))


# --- GpSimd: patterns and selection --------------------------------------------------------------------
def _affine(instr: str, p: int, free: int, pattern, offset: int, channel_multiplier: int) -> torch.Tensor:
    pattern = [list(x) for x in pattern]
    if not 1 <= len(pattern) <= 4 or any(len(x) != 2 for x in pattern):
        raise NkiValidationError(f"{instr} pattern {pattern} must be 1 to 4 [step, num] pairs")
    count = math.prod(n for _, n in pattern)
    if count != free:
        raise NkiValidationError(f"{instr} pattern {pattern} describes {count} elements per partition, the tile has {free}")
    value = torch.full((p, 1), int(offset), dtype=torch.int64) + \
        torch.arange(p, dtype=torch.int64).reshape(p, 1) * int(channel_multiplier)
    grids = torch.zeros(1, dtype=torch.int64)
    for step, num in pattern:
        grids = (grids.reshape(-1, 1) + torch.arange(num, dtype=torch.int64).reshape(1, -1) * int(step)).reshape(-1)
    # 32-bit integer arithmetic, as on the GpSimd Engine
    return ((value + grids.reshape(1, -1) + 2**31) % 2**32) - 2**31


def iota(dst: NkiTensor, pattern, offset=0, channel_multiplier=0, name=None):
    _op.tile("iota", "dst", dst, buffers=(SBUF,))
    values = _affine("iota", dst.partitions, dst.free_size, pattern, offset, channel_multiplier)
    _op.write(dst, values.to(torch.float32) if dst.dtype.is_float else values)
    _op.issue("iota", costs.GPSIMD, costs.alu(current().target, costs.GPSIMD, dst.free_size), [], [dst])


def affine_select(dst: NkiTensor, pattern, channel_multiplier, on_true_tile: NkiTensor, on_false_value,
                  cmp_op=ops.equal, offset=0, name=None):
    _op.tile("affine_select", "dst", dst, buffers=(SBUF,))
    _op.tile("affine_select", "on_true_tile", on_true_tile, buffers=(SBUF,))
    _op.same_layout("affine_select", "on_true_tile", on_true_tile, "dst", dst)
    cmp_op = ops.as_operator(cmp_op, instr="affine_select", what="cmp_op")
    values = _affine("affine_select", dst.partitions, dst.free_size, pattern, offset, channel_multiplier)
    predicate = cmp_op.fn(values.to(torch.float32), torch.zeros(())) != 0
    if on_true_tile.dtype == dst.dtype:
        chosen = _op.read(on_true_tile)
        false = torch.full_like(chosen, 0) + dt.decode(dt.encode(torch.tensor([float(on_false_value)]), dst.dtype),
                                                       dst.dtype)[0].to(chosen.dtype)
        _op.write(dst, torch.where(predicate, chosen, false))
    else:
        _op.write(dst, torch.where(predicate, _op.read_f32(on_true_tile), torch.tensor(float(on_false_value))))
    _op.issue("affine_select", costs.GPSIMD, costs.alu(current().target, costs.GPSIMD, dst.free_size),
           [on_true_tile], [dst])


def range_select(dst: NkiTensor, on_true_tile: NkiTensor, comp_op0, comp_op1, bound0: NkiTensor, bound1: NkiTensor,
                 reduce_cmd=reduce_cmd.reset_reduce, reduce_res=None, reduce_op=ops.maximum, range_start=0,
                 on_false_value=-3.4028234663852886e38, name=None):
    if current().target.version < 3:
        raise NkiValidationError("range_select is available on NeuronCore-v3 (trn2) and newer")
    _op.tile("range_select", "dst", dst)
    _op.tile("range_select", "on_true_tile", on_true_tile)
    _op.same_layout("range_select", "on_true_tile", on_true_tile, "dst", dst)
    allowed = (ops.equal, ops.less, ops.less_equal, ops.greater, ops.greater_equal)
    c0 = ops.as_operator(comp_op0, instr="range_select", what="comp_op0")
    c1 = ops.as_operator(comp_op1, instr="range_select", what="comp_op1")
    if c0 not in allowed or c1 not in allowed:
        raise NkiValidationError("range_select comparison operators must be nl.equal, nl.less, nl.less_equal, "
                                 "nl.greater or nl.greater_equal")
    p, f = on_true_tile.partitions, on_true_tile.free_size
    b0 = _op.column("range_select", "bound0", bound0, p)
    b1 = _op.column("range_select", "bound1", bound1, p)
    index = (range_start + torch.arange(f, dtype=torch.float32)).reshape(1, f)
    mask = (c0.fn(index, b0) != 0) & (c1.fn(index, b1) != 0)
    out = torch.where(mask, _op.read_f32(on_true_tile), torch.tensor(float(on_false_value), dtype=torch.float64).float())
    _op.write(dst, out)
    _op.accumulate(current(), "vector_acc", "range_select", out, reduce_op, reduce_cmd, reduce_res)
    _op.issue("range_select", costs.VECTOR, costs.alu(current().target, costs.VECTOR, f), [on_true_tile, bound0, bound1],
           [dst] + ([reduce_res] if reduce_res is not None else []))


# --- Vector: statistics ---------------------------------------------------------------------------------
def bn_stats(dst: NkiTensor, data: NkiTensor, name=None):
    _op.tile("bn_stats", "dst", dst)
    _op.tile("bn_stats", "data", data)
    fmax = current().target.bn_stats_fmax
    if data.free_size > fmax:
        raise NkiValidationError(f"bn_stats data has {data.free_size} elements per partition, exceeding maximum {fmax} "
                                 f"(nl.tile_size.bn_stats_fmax): run bn_stats per {fmax}-element tile, then one bn_aggr")
    if dst.partitions != data.partitions or dst.free_size != 6:
        raise NkiValidationError(f"bn_stats dst must be ({data.partitions}, 6), got {dst.shape}")
    _op.close_psum(data)
    x = _op.read_f32(data)
    parts = []
    for half in (x[:, 0::2], x[:, 1::2]):
        n = half.shape[1]
        mean = half.mean(1) if n else torch.zeros(x.shape[0])
        m2 = ((half - mean.unsqueeze(1)) ** 2).sum(1) if n else torch.zeros(x.shape[0])
        parts += [torch.full_like(mean, float(n)), mean, m2]
    _op.write(dst, torch.stack(parts, 1))
    _op.issue("bn_stats", costs.VECTOR, costs.alu(current().target, costs.VECTOR, data.free_size), [data], [dst])


def bn_aggr(dst: NkiTensor, data: NkiTensor, name=None):
    _op.tile("bn_aggr", "dst", dst)
    _op.tile("bn_aggr", "data", data)
    if data.free_size % 3:
        raise NkiValidationError(f"bn_aggr data must hold (count, mean, variance*count) triples: {data.free_size} "
                                 f"elements per partition is not a multiple of 3")
    if dst.partitions != data.partitions or dst.free_size != 2:
        raise NkiValidationError(f"bn_aggr dst must be ({data.partitions}, 2), got {dst.shape}")
    _op.close_psum(data)
    t = _op.read_f32(data).reshape(data.partitions, -1, 3)
    count, mean, m2 = t[..., 0], t[..., 1], t[..., 2]
    n = count.sum(1)
    total_mean = (count * mean).sum(1) / n
    total_m2 = (m2 + count * (mean - total_mean.unsqueeze(1)) ** 2).sum(1)
    _op.write(dst, torch.stack([total_mean, total_m2 / n], 1))
    _op.issue("bn_aggr", costs.VECTOR, costs.alu(current().target, costs.VECTOR, data.free_size), [data], [dst])
