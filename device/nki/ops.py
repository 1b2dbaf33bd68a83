"""NKI's operators: the math an instruction's `op` names, and the functions of `nki.language`.

`nl.add`, `nl.exp`, ... are both things a kernel calls (`nl.add(a, b)` makes a new tile) and
the names it passes to an instruction (`nisa.tensor_tensor(dst, a, b, op=nl.add)`). Each is an
`Operator`: callable (the language's tile-level function, installed by language.py) and
carrying its element-wise math for the instructions. The math is the engines' (see the
"Supported Math Operators" and "Supported Activation Functions" tables of the NKI API docs):
arithmetic in float32, comparisons giving 1.0 or 0.0, bitvec operators on the integer bit
patterns. The Scalar Engine approximates activation functions with polynomials; the emulator
computes them exactly in float32 (so `sin` outside [-pi, pi] is accurate here, where the
chip's is not).
"""
from __future__ import annotations

import math

import numpy as np
import torch

ARITH, BITVEC, ACTIVATION = "arithmetic", "bitvec", "activation"


class Operator:
    # language.py installs the tile-level implementation: nl.add(a, b) -> a new tile
    high_level = None

    def __init__(self, name: str, fn, *, arity: int, kind: str = ARITH, identity=None, activation: bool = False):
        self.name = name
        self.fn = fn  # torch math: fn(x) or fn(x, y)
        self.arity = arity
        self.kind = kind
        self.identity = identity  # the start of a reduction by this operator; None: no reduction
        self.activation = activation  # accepted as nisa.activation's op

    def __call__(self, *args, **kwargs):
        return Operator.high_level(self, *args, **kwargs)

    def __repr__(self) -> str:
        return f"nl.{self.name}"

    def __reduce__(self):  # pickles (and deep-copies) by name
        return (by_name, (self.name,))


def _b(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32)


def _gelu_dx(x):
    return 0.5 * (1 + torch.erf(x / math.sqrt(2))) + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _silu_dx(x):
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))


def _gelu_sigmoid(x):
    return x * torch.sigmoid(1.702 * x)


def _gelu_sigmoid_dx(x):
    s = torch.sigmoid(1.702 * x)
    return s + 1.702 * x * s * (1 - s)


_OPS: dict[str, Operator] = {}


def _op(name, fn, arity, **kw) -> Operator:
    op = _OPS[name] = Operator(name, fn, arity=arity, **kw)
    return op


def _shift_right(x, y):  # logical: on the unsigned bit pattern
    return torch.bitwise_right_shift(x.to(torch.int64) & 0xFFFFFFFF, y)


# binary arithmetic
add = _op("add", torch.add, 2, identity=0.0)
subtract = _op("subtract", torch.sub, 2, identity=0.0)
multiply = _op("multiply", torch.mul, 2, identity=1.0)
divide = _op("divide", torch.div, 2)
maximum = _op("maximum", torch.maximum, 2, identity=-math.inf)
minimum = _op("minimum", torch.minimum, 2, identity=math.inf)
power = _op("power", torch.pow, 2)
abs_max = _op("abs_max", lambda x, y: torch.maximum(x.abs(), y.abs()), 2)
abs_min = _op("abs_min", lambda x, y: torch.minimum(x.abs(), y.abs()), 2)
fmod = _op("fmod", torch.fmod, 2)
mod = _op("mod", torch.remainder, 2)
equal = _op("equal", lambda x, y: _b(x == y), 2)
not_equal = _op("not_equal", lambda x, y: _b(x != y), 2)
less = _op("less", lambda x, y: _b(x < y), 2)
less_equal = _op("less_equal", lambda x, y: _b(x <= y), 2)
greater = _op("greater", lambda x, y: _b(x > y), 2)
greater_equal = _op("greater_equal", lambda x, y: _b(x >= y), 2)
logical_and = _op("logical_and", lambda x, y: _b((x != 0) & (y != 0)), 2, identity=1.0)
logical_or = _op("logical_or", lambda x, y: _b((x != 0) | (y != 0)), 2, identity=0.0)
logical_xor = _op("logical_xor", lambda x, y: _b((x != 0) ^ (y != 0)), 2, identity=0.0)
# bitvec
bitwise_and = _op("bitwise_and", torch.bitwise_and, 2, kind=BITVEC, identity=-1)
bitwise_or = _op("bitwise_or", torch.bitwise_or, 2, kind=BITVEC, identity=0)
bitwise_xor = _op("bitwise_xor", torch.bitwise_xor, 2, kind=BITVEC, identity=0)
left_shift = _op("left_shift", torch.bitwise_left_shift, 2, kind=BITVEC)
right_shift = _op("right_shift", _shift_right, 2, kind=BITVEC)
invert = _op("invert", torch.bitwise_not, 1, kind=BITVEC)
logical_not = _op("logical_not", lambda x: _b(x == 0), 1)

# unary: the ALU's (usable as tensor_scalar's op0) and the Scalar Engine's activation functions
copy = _op("copy", lambda x: x, 1, activation=True)
abs = _op("abs", torch.abs, 1, activation=True)  # noqa: A001 (NKI's name)
square = _op("square", torch.square, 1, activation=True)
relu = _op("relu", torch.relu, 1, activation=True)
rsqrt = _op("rsqrt", torch.rsqrt, 1, activation=True)
reciprocal = _op("reciprocal", torch.reciprocal, 1, activation=True)
sigmoid = _op("sigmoid", torch.sigmoid, 1, activation=True)
prelu = _op("prelu", torch.relu, 1, activation=True)  # slope 0 unless an instruction gives relu_param
gelu = _op("gelu", lambda x: torch.nn.functional.gelu(x), 1, activation=True)
gelu_dx = _op("gelu_dx", _gelu_dx, 1, activation=True)
gelu_apprx_tanh = _op("gelu_apprx_tanh", lambda x: torch.nn.functional.gelu(x, approximate="tanh"), 1, activation=True)
gelu_apprx_sigmoid = _op("gelu_apprx_sigmoid", _gelu_sigmoid, 1, activation=True)
gelu_apprx_sigmoid_dx = _op("gelu_apprx_sigmoid_dx", _gelu_sigmoid_dx, 1, activation=True)
silu = _op("silu", torch.nn.functional.silu, 1, activation=True)
silu_dx = _op("silu_dx", _silu_dx, 1, activation=True)
tanh = _op("tanh", torch.tanh, 1, activation=True)
softplus = _op("softplus", torch.nn.functional.softplus, 1, activation=True)
mish = _op("mish", torch.nn.functional.mish, 1, activation=True)
erf = _op("erf", torch.erf, 1, activation=True)
erf_dx = _op("erf_dx", lambda x: 2 / math.sqrt(math.pi) * torch.exp(-x * x), 1, activation=True)
exp = _op("exp", torch.exp, 1, activation=True)
log = _op("log", torch.log, 1, activation=True)
sin = _op("sin", torch.sin, 1, activation=True)
arctan = _op("arctan", torch.atan, 1, activation=True)
sqrt = _op("sqrt", torch.sqrt, 1, activation=True)
sign = _op("sign", torch.sign, 1, activation=True)
# unary functions of nki.language that run as several instructions (no single ALU op)
cos = _op("cos", torch.cos, 1)
tan = _op("tan", torch.tan, 1)
ceil = _op("ceil", torch.ceil, 1)
floor = _op("floor", torch.floor, 1)
trunc = _op("trunc", torch.trunc, 1)
negative = _op("negative", torch.neg, 1)

# Kernels written against older NKI releases pass numpy's functions as operators.
_NUMPY = {np.add: add, np.subtract: subtract, np.multiply: multiply, np.divide: divide, np.true_divide: divide,
          np.maximum: maximum, np.minimum: minimum, np.power: power, np.equal: equal, np.not_equal: not_equal,
          np.less: less, np.less_equal: less_equal, np.greater: greater, np.greater_equal: greater_equal,
          np.bitwise_and: bitwise_and, np.bitwise_or: bitwise_or, np.bitwise_xor: bitwise_xor,
          np.left_shift: left_shift, np.right_shift: right_shift, np.invert: invert, np.exp: exp, np.log: log,
          np.tanh: tanh, np.abs: abs, np.absolute: abs, np.sqrt: sqrt, np.square: square, np.sin: sin,
          np.arctan: arctan, np.sign: sign, np.reciprocal: reciprocal, np.negative: negative,
          np.logical_and: logical_and, np.logical_or: logical_or, np.logical_xor: logical_xor,
          # reductions name numpy's reducing functions (neuronxcc's tensor_reduce(np.max, ...))
          np.max: maximum, np.amax: maximum, np.min: minimum, np.amin: minimum}


def by_name(name: str) -> Operator:
    return _OPS[name]


def as_operator(op, *, instr: str, what: str = "op") -> Operator:
    """The Operator a kernel names, or an error naming the instruction and what it got."""
    if isinstance(op, Operator):
        return op
    found = _NUMPY.get(op) if _hashable(op) else None
    if found is None:
        raise TypeError(f"{instr}: {what}={op!r} is not an NKI operator; pass one of nki.language's, e.g. nl.add, "
                        f"nl.multiply, nl.maximum, nl.exp")
    return found


def _hashable(x) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True
