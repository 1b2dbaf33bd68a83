"""nki.language on the emulated NeuronCore: views, memories, dtypes and the chip's limits.

The view rules are the NKI language guide's own examples; the limits are trn2's and trn3's
(device/nki/target.py names the sources).
"""
from __future__ import annotations

import importlib
import sys
import types

import numpy as np
import pytest
import torch

import adaptive_eager.nki as nki
import adaptive_eager.nki.isa as nisa
import adaptive_eager.nki.language as nl
from adaptive_eager.device.nki import dtypes as dt
from subproc import run_python


def filled(values: torch.Tensor, dtype=nl.float32, buffer=nl.sbuf):
    t = nl.ndarray(tuple(values.shape), dtype, buffer)
    t.torch_view().copy_(dt.encode(values, t.dtype))
    return t


# --- views: the language guide's examples ------------------------------------------------------
def test_a_fresh_tile_is_contiguous_with_the_guides_strides():
    t = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
    assert (t.shape, t.strides, t.offset, t.ndim, t.size) == ((128, 64), (64, 1), 0, 2, 128 * 64)
    assert t.dtype == nl.float32 and t.buffer == nl.sbuf and t.is_contiguous()


def test_integer_indexing_keeps_on_chip_tensors_two_dimensional():
    t = nl.ndarray((64, 64, 64), dtype=nl.float32, buffer=nl.sbuf)
    assert t[0, 0, 10].shape == (1, 1)
    assert t[:, 0].shape == (64, 64)
    assert t[:, 0, 10].shape == (64, 1)
    assert t[0, ..., :].shape == (1, 64, 64)
    assert t[:, :, ::2].shape == (64, 64, 32)
    assert t[0:64, 0, 0:64].shape == (64, 64)


def test_integer_indexing_drops_hbm_dimensions():
    h = nl.ndarray((4, 128, 32), dtype=nl.float32, buffer=nl.shared_hbm)
    assert h[0, :, :].shape == (128, 32)
    assert h[1, 2].shape == (32,)


def test_views_share_storage_so_a_write_through_one_shows_in_the_others():
    t = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=t, value=0.0)
    u = t.reshape((128, 8, 8))
    nisa.memset(dst=u[:, 2:4, :], value=1.0)
    assert torch.equal(t.values()[:, 16:32], torch.ones(128, 16))
    assert torch.equal(t.values()[:, :16], torch.zeros(128, 16))


def test_a_slice_has_the_access_pattern_of_the_deep_dive():
    t = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
    u = t.slice(dim=1, start=8, end=24)
    assert u.get_pattern() == [[64, 128], [1, 16]] and u.offset == 8
    v = t.ap(pattern=[[64, 128], [1, 16]], offset=8)
    assert v.get_pattern() == u.get_pattern() and v.offset == u.offset


def test_composed_views_address_the_elements_torch_would():
    x = torch.arange(128 * 4 * 16, dtype=torch.float32).reshape(128, 4, 16)
    t = filled(x)
    u = t[0:64, :, :].permute((0, 2, 1))[:, 0, :]
    assert u.shape == (64, 4)
    assert torch.equal(u.values(), x[0:64].permute(0, 2, 1)[:, 0, :])
    w = t.reshape((128, 64)).reshape_dim(1, (8, -1)).flatten_dims(1, 2)
    assert torch.equal(w.values(), x.reshape(128, 64))
    r = t.rearrange(("p", "a", "b"), ("p", "b", "a"))
    assert torch.equal(r.values(), x.permute(0, 2, 1))


def test_broadcast_repeats_elements_with_a_zero_stride():
    t = filled(torch.arange(8.0).reshape(8, 1, 1))
    b = t.broadcast(1, 3)
    assert b.shape == (8, 3, 1) and b.strides[1] == 0
    assert torch.equal(b.values(), torch.arange(8.0).reshape(8, 1, 1).expand(8, 3, 1))


def test_view_dtype_rescales_the_last_dimension():
    t = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
    assert t.view(nl.uint8).shape == (128, 256)
    assert t.view(nl.int32).shape == (128, 64)
    u = nl.ndarray((128, 256), dtype=nl.uint8, buffer=nl.sbuf)
    assert u.view(nl.float32).shape == (128, 64)


@pytest.mark.parametrize("make, message", [
    (lambda t: t.permute((1, 0)), "partition dim first"),
    (lambda t: t.reshape((64, 128)), "must keep its partition dim"),
    (lambda t: t[0:1].broadcast(0, 4), "partition dimension"),
    (lambda t: t[:, 64:70], "out of bounds"),
    (lambda t: t[200], "out of bounds"),
    (lambda t: t.ap(pattern=[[32, 128], [1, 32]]), "partition stride"),
])
def test_views_that_would_move_data_across_partitions_or_out_of_bounds_raise(make, message):
    t = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
    with pytest.raises(nisa.NkiValidationError, match=message):
        make(t)


def test_a_permuted_view_cannot_be_reshaped_without_a_copy():
    t = nl.ndarray((128, 4, 8), dtype=nl.float32, buffer=nl.sbuf)
    with pytest.raises(nisa.NkiValidationError, match="without a copy"):
        t.permute((0, 2, 1)).reshape((128, 32))


# --- memory: fresh tiles, capacity ---------------------------------------------------------------------
def test_fresh_memory_holds_the_simulators_sentinels():
    assert torch.isnan(nl.ndarray((4, 8), nl.bfloat16).values()).all()
    assert torch.isnan(nl.ndarray((4, 8), nl.float8_e4m3).values()).all()
    assert (nl.ndarray((4, 8), nl.int32).values() == 4).all()
    assert torch.isnan(nl.ndarray((4, 8), nl.float32, buffer=nl.psum).values()).all()


def test_sbuf_capacity_is_224_kib_per_partition_on_trn2():
    kept = [nl.ndarray((128, 16 * 1024), nl.float32) for _ in range(3)]  # 3 x 64 KiB per partition
    with pytest.raises(nisa.NkiValidationError, match=r"SBUF is full.*65536 bytes per partition.*196608 of the 229376"):
        nl.ndarray((128, 16 * 1024), nl.float32)
    del kept
    nl.ndarray((128, 16 * 1024), nl.float32)  # the first three went out of scope: room again


def test_psum_holds_eight_banks_of_two_kib_per_partition():
    banks = [nl.ndarray((128, 512), nl.float32, buffer=nl.psum) for _ in range(8)]
    with pytest.raises(nisa.NkiValidationError, match="PSUM is full.*needs 1 of the 8 PSUM banks.*8 are held"):
        nl.ndarray((128, 2), nl.float32, buffer=nl.psum)
    banks.pop()
    nl.ndarray((128, 2), nl.float32, buffer=nl.psum)


def test_tile_size_constants_follow_the_target(monkeypatch):
    assert (nl.tile_size.pmax, nl.tile_size.psum_bank_fmax, nl.tile_size.gemm_stationary_fmax,
            nl.tile_size.gemm_moving_fmax, nl.tile_size.bn_stats_fmax) == (128, 512, 128, 512, 512)

    @nki.jit
    def report(x):
        return (nl.tile_size.sbuf_fmax_bytes, nl.tile_size.gemm_moving_fmax, nisa.get_nc_version())

    assert report(torch.zeros(1)) == (224 * 1024, 512, nisa.nc_version.gen3)
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    assert report(torch.zeros(1)) == (256 * 1024, 4096, nisa.nc_version.gen4)


# --- dtypes ----------------------------------------------------------------------------------------------
def test_ieee_float8_e4m3_rounds_to_nearest_even_and_overflows_to_inf():
    x = torch.tensor([1.0625, 1.1875, 240.0, 247.0, 248.0, -3.5, 2.0**-10, float("nan")])
    back = dt.decode(dt.encode(x, dt.float8_e4m3), dt.float8_e4m3)
    expect = torch.tensor([1.0, 1.25, 240.0, 240.0, float("inf"), -3.5, 0.0, float("nan")])
    assert torch.equal(back.nan_to_num(7.0), expect.nan_to_num(7.0))


def test_tfloat32_keeps_ten_mantissa_bits():
    x = torch.tensor([1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-10])
    back = dt.decode(dt.encode(x, dt.tfloat32), dt.tfloat32)
    assert torch.equal(back, torch.tensor([1.0, 1 + 2.0**-9, 1 + 2.0**-10]))


def test_dtypes_are_nki_names_and_accept_numpy_and_torch_spellings():
    assert nl.float32 == "float32" and nl.bfloat16 == "bfloat16"
    assert dt.as_dtype(np.float16) is nl.float16 and dt.as_dtype(torch.int8) is nl.int8
    with pytest.raises(TypeError, match="int64 and float64 have no NeuronCore equivalent"):
        dt.as_dtype(torch.int64)


# --- install(): `import nki` only when asked, never over a real one -------------------------------------
def test_install_makes_import_nki_the_emulator_and_uninstall_removes_it():
    nki.install()
    try:
        assert importlib.import_module("nki") is nki
        assert importlib.import_module("nki.language") is nl
        assert importlib.import_module("nki.isa") is nisa
    finally:
        nki.uninstall()
    assert "nki" not in sys.modules


def test_install_refuses_to_shadow_a_real_nki(monkeypatch):
    monkeypatch.setitem(sys.modules, "nki", types.ModuleType("nki"))
    with pytest.raises(RuntimeError, match="never shadows it"):
        nki.install()


def test_the_environment_switch_installs_nki_only_and_leaves_neuronxcc_alone():
    # a decision, pinned: neuronxcc is the compiler's package; ADAPTIVE_EAGER_NKI is documented
    # (device/settings.py) as install() alone, and install_neuronxcc() stays an explicit call
    proc = run_python("""
        import sys
        import torch
        import nki
        import adaptive_eager.nki.neuronxcc as stand_in
        print(nki.__name__, sys.modules.get("neuronxcc.nki") is stand_in)
    """, env={"ADAPTIVE_EAGER_NKI": "1"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["adaptive_eager.nki", "False"]


def test_the_environment_switch_makes_import_nki_the_emulator_at_import_torch():
    proc = run_python("""
        import torch
        import nki, nki.language as nl, nki.isa as nisa
        print(nl.__name__, nisa.__name__, nki.__name__)
    """, env={"ADAPTIVE_EAGER_NKI": "1"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["adaptive_eager.device.nki.language", "adaptive_eager.device.nki.isa", "adaptive_eager.nki"]
