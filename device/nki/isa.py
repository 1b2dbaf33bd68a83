"""nki.isa: the NeuronCore's instructions, executed now on the host copy of on-chip memory.

Each instruction checks its operands as the NKI simulator does (memory, partition and tile
limits, data types), computes what the docstring of nki.isa says it computes, writes its
destination and hands a record of itself (engine, duration, what it read and wrote) to the
kernel's timeline (timeline.py). Arithmetic is float32, as on the engines: inputs are cast to
float32, the result is rounded to the destination's dtype once (round to nearest even).
Copies between equal dtypes move bits. The instructions live in isa_move.py (DMA and copies),
isa_tensor.py (the Tensor Engine), isa_alu.py (Vector/Scalar/GpSimd arithmetic), isa_scan.py,
isa_search.py, isa_lnc.py, isa_rng.py and isa_mx.py (the MX formats); this module is the
namespace kernels call them by.
"""
from __future__ import annotations

import torch

from . import operands as _op
from .constants import (  # noqa: F401  (nki.isa's enumerations)
    dge_mode, dma_engine, engine, matmul_perf_mode, nc_version, oob_mode, reduce_cmd)
from .errors import NkiValidationError  # noqa: F401  (nki.isa.NkiValidationError)
from .program import current
from .tensor import SBUF, NkiTensor

tensor_engine, vector_engine, scalar_engine = engine.tensor, engine.vector, engine.scalar
gpsimd_engine, unknown_engine = engine.gpsimd, engine.unknown


def get_nc_version() -> nc_version:
    return nc_version(current().target.version)


def get_nc_sub_version() -> int:
    return 0


class VirtualRegister:
    """A 32-bit engine register (nisa.register_alloc); `value` is what it holds now."""

    def __init__(self, state=None, frozen=False):
        self.value = int(state or 0)
        self.frozen = frozen

    def __index__(self):
        return self.value

    def __int__(self):
        return self.value

    def __bool__(self):
        return self.value != 0

    def __repr__(self):
        return f"VirtualRegister({self.value})"


def register_alloc(x: int | None = None) -> VirtualRegister:
    return VirtualRegister(x or 0)


def register_move(dst: VirtualRegister, src) -> None:
    _writable_register(dst)
    dst.value = int(src.value if isinstance(src, VirtualRegister) else src)


def register_load(dst: VirtualRegister, src: NkiTensor) -> None:
    _writable_register(dst)
    _op.tile("register_load", "src", src, buffers=(SBUF,))
    if src.size != 1:
        raise NkiValidationError(f"register_load src must be a 1x1 SBUF tile, got {src.shape}")
    dst.value = int(src.values().reshape(-1)[0].item())


def register_store(dst: NkiTensor, src: VirtualRegister) -> None:
    _op.tile("register_store", "dst", dst, buffers=(SBUF,))
    _op.write(dst, torch.full((dst.partitions, dst.free_size), float(src.value)))


def _writable_register(r) -> None:
    if not isinstance(r, VirtualRegister):
        raise NkiValidationError(f"expected a VirtualRegister (nisa.register_alloc()), got {type(r).__name__}")
    if r.frozen:
        raise NkiValidationError("the induction register of a dynamic loop cannot be written")


# The instructions, by kind, under nki.isa as the kernels name them.
from .isa_alu import (activate2, activation, activation_reduce, affine_select, bn_aggr, bn_stats, iota,  # noqa: E402,F401
                      range_select, reciprocal, scalar_tensor_tensor, tensor_reduce, tensor_scalar,
                      tensor_scalar_reduce, tensor_tensor)
from .isa_lnc import core_barrier, sendrecv  # noqa: E402,F401
from .isa_mx import nc_matmul_mx, quantize_mx  # noqa: E402,F401
from .isa_rng import rand2, rand_get_state, rand_set_state  # noqa: E402,F401
from .isa_move import (assign, dma_compute, dma_copy, dma_transpose, memset, tensor_copy,  # noqa: E402,F401
                       tensor_copy_predicated)
from .isa_scan import (exponential, select_reduce, tensor_partition_reduce, tensor_scalar_cumulative,  # noqa: E402,F401
                       tensor_tensor_scan)
from .isa_search import (local_gather, max8, nc_find_index8, nc_match_replace8, nc_n_gather,  # noqa: E402,F401
                         nc_stream_shuffle, nonzero_with_count)
from .isa_tensor import nc_matmul, nc_transpose  # noqa: E402,F401
