"""torch.neuron against torch.cuda, name by name.

Every public name of torch.cuda (its __all__, plus the error types training code catches)
is in exactly one of two tables: PRESENT, where torch.neuron has it with torch.cuda's
behaviour (the file that tests it beside each), or ABSENT, with why it cannot be. A torch
release that adds a name fails the first test until the name is placed in one of them.
"""
import pytest
import torch

# name -> the tests that pin its behaviour
PRESENT = {
    "is_available": "test_device_api.py", "is_initialized": "here", "init": "here",
    "device_count": "test_device_api.py", "current_device": "test_device_api.py",
    "set_device": "test_device_api.py", "device": "test_device_api.py", "device_of": "here",
    "synchronize": "test_streams_events.py",
    "Stream": "test_streams_events.py", "Event": "test_streams_events.py", "StreamContext": "here",
    "stream": "test_streams_events.py", "current_stream": "test_streams_events.py",
    "default_stream": "test_streams_events.py", "set_stream": "here",
    "is_current_stream_capturing": "here",
    "manual_seed": "test_device_api.py", "manual_seed_all": "test_device_api.py", "seed": "test_device_api.py",
    "seed_all": "test_device_api.py", "initial_seed": "test_device_api.py", "get_rng_state": "test_device_api.py",
    "get_rng_state_all": "here", "set_rng_state": "test_device_api.py",
    "set_rng_state_all": "here",
    "memory_allocated": "test_device_api.py", "max_memory_allocated": "test_device_api.py",
    "memory_reserved": "test_device_api.py", "max_memory_reserved": "here",
    "reset_peak_memory_stats": "test_device_api.py", "memory_stats": "test_device_api.py",
    "mem_get_info": "test_device_api.py", "memory_summary": "here", "empty_cache": "test_device_api.py",
    "set_per_process_memory_fraction": "here", "get_per_process_memory_fraction": "here",
    "reset_max_memory_allocated": "here", "reset_accumulated_memory_stats": "here",
    "memory_stats_as_nested_dict": "here", "memory_cached": "here", "max_memory_cached": "here",
    "reset_max_memory_cached": "here", "device_memory_used": "here",
    "get_device_properties": "test_device_api.py", "get_device_name": "test_device_api.py",
    "get_device_capability": "here", "get_arch_list": "here", "can_device_access_peer": "here",
    "is_bf16_supported": "test_device_api.py",
    "OutOfMemoryError": "here", "AcceleratorError": "here",
}

_NO_CAPTURE = ("no graph capture on neuron: the adaptive engine replays repeating op sequences as one launch "
               "by itself, and torch.compile(backend='neuron') makes a graph one launch explicitly")
_LEGACY_TYPE = ("a legacy typed tensor/storage class: make tensors with torch.tensor/torch.empty(..., "
                "device='neuron') and storages with untyped_storage()")
_NO_CACHE = ("the emulated allocator has no cache to manage or replace: every block is freed when its "
             "last holder drops it (memory.cpp)")
_NO_SENSORS = "no hardware to read: the emulator models time and memory, not power, heat or clocks"
_CUDA_ONLY = "CUDA's own toolchain or libraries, with nothing of the kind on Trainium"
_HOST_STATS = "CUDA's pinned-host allocator statistics: neuron's pinned memory is plain host memory, not counted"

ABSENT = {
    **{f"{kind}{suffix}": _LEGACY_TYPE
       for kind in ("BFloat16", "Bool", "Byte", "Char", "Double", "Float", "Half", "Int", "Long", "Short")
       for suffix in ("Storage", "Tensor")},
    "ComplexDoubleStorage": _LEGACY_TYPE, "ComplexFloatStorage": _LEGACY_TYPE,
    "CUDAGraph": _NO_CAPTURE, "graph": _NO_CAPTURE, "graphs": _NO_CAPTURE, "graph_pool_handle": _NO_CAPTURE,
    "make_graphed_callables": _NO_CAPTURE,
    "CUDAPluggableAllocator": _NO_CACHE, "change_current_allocator": _NO_CACHE, "MemPool": _NO_CACHE,
    "use_mem_pool": _NO_CACHE, "caching_allocator_alloc": _NO_CACHE, "caching_allocator_delete": _NO_CACHE,
    "caching_allocator_enable": _NO_CACHE, "caching_allocator_disabled": _NO_CACHE,
    "get_allocator_backend": _NO_CACHE, "ipc_collect": _NO_CACHE,
    "memory_snapshot": ("the allocator keeps totals per device, not a record of each block: memory_stats() "
                        "and memory_summary() give what it counts"),
    "host_memory_stats": _HOST_STATS, "host_memory_stats_as_nested_dict": _HOST_STATS,
    "reset_accumulated_host_memory_stats": _HOST_STATS, "reset_peak_host_memory_stats": _HOST_STATS,
    "ExternalStream": "no runtime outside the emulator owns streams to wrap",
    "get_stream_from_external": "no runtime outside the emulator owns streams to wrap",
    "GreenContext": "no partitioning of the device's cores below a logical device (NEURON_LOGICAL_NC_CONFIG)",
    "clock_rate": _NO_SENSORS, "power_draw": _NO_SENSORS, "temperature": _NO_SENSORS, "utilization": _NO_SENSORS,
    "memory_usage": _NO_SENSORS + " (memory_allocated() is what the device holds)",
    "list_gpu_processes": "no driver to ask which processes hold the device",
    "get_sync_debug_mode": ("not yet: adaptive_eager.stats().flushes and explain() report every sync point, "
                            "by reason"),
    "set_sync_debug_mode": ("not yet: adaptive_eager.stats().flushes and explain() report every sync point, "
                            "by reason"),
    "default_generators": ("the device generators are C++'s (torch.Generator(device='neuron') makes one); "
                           "seed and read them with manual_seed, get_rng_state"),
    "is_tf32_supported": "TF32 is a CUDA math mode; neuron computes float32 as the CPU does, bit for bit",
    "amp": "deprecated on CUDA too: torch.autocast('neuron') and torch.amp.GradScaler('neuron') are the API",
    "nvtx": "profiler ranges are torch.profiler's: torch.profiler.record_function works on neuron",
    "profiler": "CUDA's profiler start/stop: torch.profiler records neuron launches (README, Profiling)",
    "CudaError": _CUDA_ONLY, "DeferredCudaCallError": _CUDA_ONLY, "check_error": _CUDA_ONLY, "cudart": _CUDA_ONLY,
    "cudaStatus": _CUDA_ONLY, "current_blas_handle": _CUDA_ONLY, "current_solver_handle": _CUDA_ONLY,
    "get_gencode_flags": _CUDA_ONLY, "has_half": _CUDA_ONLY, "has_magma": _CUDA_ONLY, "jiterator": _CUDA_ONLY,
    "nccl": "collectives on neuron go through torch.distributed (backend 'neuron')",
    "tunable": _CUDA_ONLY, "sparse": "neuron tensors are dense (README)",
    # submodules of torch.cuda, whose functions are re-exported at its top level (above)
    "memory": "a submodule: its functions are torch.neuron's own (above)",
    "random": "a submodule: its functions are torch.neuron's own (above)",
    "streams": "a submodule: Stream and Event are torch.neuron's own (above)",
}


def _cuda_names() -> set[str]:
    return set(torch.cuda.__all__) | {"OutOfMemoryError", "AcceleratorError"}


def test_every_public_torch_cuda_name_is_present_or_absent_with_a_reason():
    assert not set(PRESENT) & set(ABSENT)
    unplaced = _cuda_names() - set(PRESENT) - set(ABSENT)
    assert not unplaced, f"torch.cuda names in neither table: {sorted(unplaced)}"
    assert set(PRESENT) | set(ABSENT) <= _cuda_names(), "a table names something torch.cuda does not have"


def test_the_present_names_are_on_torch_neuron_and_the_absent_ones_are_not():
    missing = [n for n in PRESENT if not hasattr(torch.neuron, n)]
    assert not missing, f"listed as present but missing: {missing}"
    there = [n for n in ABSENT if hasattr(torch.neuron, n)]
    assert not there, f"listed as absent but on torch.neuron (move them to PRESENT, with a test): {there}"


@pytest.mark.parametrize("name", sorted(n for n, where in PRESENT.items() if where != "here"))
def test_each_present_name_is_tested_where_the_table_says(name):
    import pathlib
    text = (pathlib.Path(__file__).parent / PRESENT[name]).read_text()
    assert name in text


# -- the behaviour of the names tested here -------------------------------------------------
def test_a_per_process_memory_fraction_caps_allocations_as_on_cuda():
    total = torch.neuron.get_device_properties(0).total_memory
    assert torch.neuron.get_per_process_memory_fraction() == 1.0
    torch.neuron.set_per_process_memory_fraction(0.25)
    try:
        assert torch.neuron.get_per_process_memory_fraction() == 0.25
        with pytest.raises(torch.neuron.OutOfMemoryError, match="set_per_process_memory_fraction"):
            torch.empty(total // 3, dtype=torch.uint8, device="neuron")
        x = torch.empty(1024, device="neuron")  # below the cap: fine
        assert x.numel() == 1024
    finally:
        torch.neuron.set_per_process_memory_fraction(1.0)
    assert torch.neuron.OutOfMemoryError is torch.OutOfMemoryError
    for bad, error in ((1.5, ValueError), (-0.1, ValueError), ("half", TypeError)):
        with pytest.raises(error, match="fraction"):
            torch.neuron.set_per_process_memory_fraction(bad)


def test_the_memory_aliases_and_resets_report_the_same_books():
    torch.neuron.reset_peak_memory_stats()
    x = torch.empty(1 << 20, dtype=torch.uint8, device="neuron")
    del x
    assert torch.neuron.max_memory_allocated() >= 1 << 20
    assert torch.neuron.max_memory_cached() == torch.neuron.max_memory_reserved()
    assert torch.neuron.memory_cached() == torch.neuron.memory_reserved() == torch.neuron.memory_allocated()
    assert torch.neuron.device_memory_used() == torch.neuron.memory_allocated()
    torch.neuron.reset_max_memory_allocated()
    assert torch.neuron.max_memory_allocated() == torch.neuron.memory_allocated()
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(1 << 50, dtype=torch.uint8, device="neuron")
    assert torch.neuron.memory_stats()["num_ooms"] >= 1
    torch.neuron.reset_accumulated_memory_stats()
    assert torch.neuron.memory_stats()["num_ooms"] == 0
    flat, nested = torch.neuron.memory_stats(), torch.neuron.memory_stats_as_nested_dict()
    assert nested["allocated_bytes"]["all"]["current"] == flat["allocated_bytes.all.current"]
    assert nested["num_ooms"] == flat["num_ooms"]


def test_device_of_makes_a_tensors_device_current_for_the_block():
    assert torch.neuron.device_count() >= 2
    with torch.neuron.device_of(torch.ones(1, device="neuron:1")):
        assert torch.neuron.current_device() == 1
        assert torch.empty(1, device="neuron").device == torch.device("neuron:1")
    assert torch.neuron.current_device() == 0
    with torch.neuron.device_of(torch.ones(1)):  # not on neuron: nothing changes
        assert torch.neuron.current_device() == 0


def test_the_device_facts_of_the_emulator():
    torch.neuron.init()  # nothing to do, and says so by doing nothing
    assert torch.neuron.is_initialized()
    assert not torch.neuron.is_current_stream_capturing()
    assert torch.neuron.get_arch_list() == ["trn2", "trn3"]
    assert torch.neuron.can_device_access_peer(0, 1) and not torch.neuron.can_device_access_peer(0, 0)
    with pytest.raises(AssertionError, match="Invalid peer device id: neuron:99"):  # torch.cuda's type
        torch.neuron.can_device_access_peer(0, 99)
    assert torch.neuron.AcceleratorError is torch.AcceleratorError


def test_set_stream_and_a_stream_context_switch_the_current_stream_and_restore_it():
    default = torch.neuron.current_stream()
    side = torch.neuron.Stream()
    ctx = torch.neuron.stream(side)
    assert isinstance(ctx, torch.neuron.StreamContext)
    with ctx:
        assert torch.neuron.current_stream() == side
    assert torch.neuron.current_stream() == default
    torch.neuron.set_stream(side)
    try:
        assert torch.neuron.current_stream() == side
    finally:
        torch.neuron.set_stream(default)


def test_all_devices_rng_states_round_trip():
    # A device's state is its seed and offset (Note [Random ops draw from CPU's generator]).
    for i in range(torch.neuron.device_count()):
        with torch.neuron.device(i):
            torch.neuron.manual_seed(100 + i)
    states = torch.neuron.get_rng_state_all()
    assert len(states) == torch.neuron.device_count()
    torch.neuron.manual_seed_all(0)
    torch.neuron.set_rng_state_all(states)
    assert [s[0].item() for s in torch.neuron.get_rng_state_all()] == [100 + i for i in range(len(states))]


def test_the_memory_summary_and_the_capability_name_the_device():
    summary = torch.neuron.memory_summary()
    assert summary.startswith("neuron:0: allocated") and "capacity" in summary
    profile = torch.neuron.get_device_properties().profile
    assert torch.neuron.get_device_capability() == (int(profile[-1]), 0)
