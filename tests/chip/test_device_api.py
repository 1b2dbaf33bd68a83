"""The `torch.neuron` device module and `torch.accelerator` on neuron: what a user of
`torch.cuda` expects, on the emulated device (counts, seeds, memory, properties, errors)."""
import pytest
import torch

from adaptive_eager.device import DeviceConfig, NeuronConfigError, NeuronDeviceError
from adaptive_eager.dispatch import CONTEXT
from subproc import run_json

# Variables that change the configuration: removed for the "default" child processes.
_CONFIG_VARS = ("NEURON_PROFILE", "NEURON_NUM_DEVICES", "NEURON_LOGICAL_NC_CONFIG",
                "NEURON_DEVICE_MEMORY", "NEURON_LAUNCH_OVERHEAD_US")
_DEFAULT_ENV = {k: None for k in _CONFIG_VARS}

_DESCRIBE = """
    import torch
    n = torch.neuron
    emit({"available": n.is_available(), "count": n.device_count(),
          "accelerator_count": torch.accelerator.device_count(),
          "capacity": n.get_device_properties(0).total_memory,
          "mem_total": n.mem_get_info()[1], "name": n.get_device_name(),
          "profile": n.get_device_properties().profile})
"""
GiB = 1024**3


@pytest.fixture
def restore_current_device():
    previous = torch.neuron.current_device()
    yield
    torch.neuron.set_device(previous)


# -- configuration (fresh processes: the runtime reads the environment once) ----------------
def test_default_configuration_is_trn2_with_four_devices_of_24_gib():
    r = run_json(_DESCRIBE, env=_DEFAULT_ENV)
    assert r["available"] is True
    assert (r["count"], r["accelerator_count"]) == (4, 4)
    assert r["capacity"] == r["mem_total"] == 24 * GiB
    assert (r["profile"], "trn2" in r["name"]) == ("trn2", True)


def test_trn3_profile_and_device_count_come_from_the_environment():
    r = run_json(_DESCRIBE, env={**_DEFAULT_ENV, "NEURON_PROFILE": "trn3", "NEURON_NUM_DEVICES": "2"})
    assert (r["count"], r["accelerator_count"]) == (2, 2)
    assert r["capacity"] == r["mem_total"] == 36 * GiB
    assert (r["profile"], "trn3" in r["name"]) == ("trn3", True)


@pytest.mark.parametrize("key, value, message", [
    ("NEURON_PROFILE", "trn9", "NEURON_PROFILE='trn9' is not a known device profile; use one of ['trn2', 'trn3']"),
    ("NEURON_NUM_DEVICES", "abc", "NEURON_NUM_DEVICES='abc' is not an integer"),
    ("NEURON_NUM_DEVICES", "0", "NEURON_NUM_DEVICES=0 is out of range; it must be >= 1"),
    ("NEURON_DEVICE_MEMORY", "lots", "NEURON_DEVICE_MEMORY='lots' is not a size"),
    ("NEURON_LOGICAL_NC_CONFIG", "3", "NEURON_LOGICAL_NC_CONFIG=3 must divide the 8 NeuronCores"),
    ("NEURON_LAUNCH_OVERHEAD_US", "-1", "NEURON_LAUNCH_OVERHEAD_US=-1.0 is negative"),
    ("NEURON_LAUNCH_OVERHEAD_US", "nan", "NEURON_LAUNCH_OVERHEAD_US='nan' is not a finite number"),
    ("NEURON_LAUNCH_OVERHEAD_US", "inf", "NEURON_LAUNCH_OVERHEAD_US='inf' is not a finite number"),
])
def test_bad_configuration_values_are_named_with_the_fix(key, value, message):
    with pytest.raises(NeuronConfigError) as err:
        DeviceConfig.from_env({key: value})
    assert message in str(err.value)


_FIRST_USES = """
    import warnings
    import torch
    out = {"cpu": torch.ones(2).sum().item()}  # import torch worked, and CPU with it
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out["available"] = torch.accelerator.is_available()
    out["warning"] = str(seen[0].message) if seen else None
    out["count"], out["probe"] = torch.neuron.device_count(), hasattr(torch.neuron, "synchronize")
    for name, use in [("factory", lambda: torch.ones(2, device="neuron")),
                      ("to", lambda: torch.nn.Linear(2, 2).to("neuron")),
                      ("tensor", lambda: torch.tensor([1.0], device="neuron")),
                      ("module", lambda: torch.neuron.synchronize()),
                      ("import", lambda: __import__("adaptive_eager"))]:
        try:
            use()
            out[name] = "worked"
        except RuntimeError as exc:
            out[name] = str(exc)
    emit(out)
"""


@pytest.mark.parametrize("key, value, message", [
    ("NEURON_NUM_DEVICES", "many", "NEURON_NUM_DEVICES='many' is not an integer"),
    ("NEURON_ADAPTIVE_EAGER", "banana", "NEURON_ADAPTIVE_EAGER='banana' is not a mode"),
    ("NEURON_LAUNCH_OVERHEAD_US", "nan", "NEURON_LAUNCH_OVERHEAD_US='nan' is not a finite number"),
])
def test_a_bad_setting_fails_at_the_first_use_of_neuron_not_at_import(key, value, message):
    # import torch used to fail, in programs that never touch neuron too.
    out = run_json(_FIRST_USES, env={**_DEFAULT_ENV, key: value})
    assert out["cpu"] == 2.0
    assert (out["available"], out["count"], out["probe"]) == (False, 0, False)  # as torch.cuda without a driver
    assert message in out["warning"]
    for use in ("factory", "to", "tensor", "module", "import"):
        assert message in out[use], (use, out[use])


def test_a_bad_setting_fixed_in_the_process_leaves_a_working_device():
    out = run_json("""
        import os
        import torch
        os.environ["NEURON_NUM_DEVICES"] = "2"
        import adaptive_eager
        x = torch.ones(2, device="neuron", requires_grad=True)
        (x * 3).sum().backward()
        emit([torch.neuron.device_count(), x.grad.tolist(), str(x.device)])
    """, env={**_DEFAULT_ENV, "NEURON_NUM_DEVICES": "many"})
    assert out == [2, [3.0, 3.0], "neuron:0"]


def test_an_unknown_mode_is_refused_not_taken_for_adaptive(monkeypatch):
    from adaptive_eager.mode import ModeSwitch

    for raw, mode in (("0", "eager"), ("eager", "eager"), ("1", "adaptive"), ("ADAPTIVE", "adaptive")):
        monkeypatch.setenv("NEURON_ADAPTIVE_EAGER", raw)
        assert ModeSwitch.default_from_env() == mode
    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER", "banana")
    with pytest.raises(NeuronConfigError, match="NEURON_ADAPTIVE_EAGER='banana' is not a mode; use 1"):
        ModeSwitch.default_from_env()


# -- current device ---------------------------------------------------------------------
def test_set_device_changes_where_unindexed_factories_allocate(restore_current_device):
    torch.neuron.set_device(1)
    assert torch.neuron.current_device() == 1
    assert torch.ones(2, device="neuron").device == torch.device("neuron:1")
    torch.neuron.set_device("neuron:2")
    assert torch.neuron.current_device() == 2
    torch.neuron.set_device(torch.device("neuron", 0))
    assert torch.ones(2, device="neuron").device == torch.device("neuron:0")


def test_set_device_rejects_an_index_out_of_range_and_another_device_type(restore_current_device):
    count = torch.neuron.device_count()
    with pytest.raises(NeuronDeviceError, match=rf"must be in \[0, {count}\) .*NEURON_NUM_DEVICES"):
        torch.neuron.set_device(count)
    with pytest.raises(ValueError, match="Expected a neuron device"):
        torch.neuron.set_device("cpu")
    assert torch.neuron.current_device() == 0


@pytest.mark.parametrize("use", [
    lambda n: torch.neuron.set_device(n),
    lambda n: torch.accelerator.set_device_index(n),
    lambda n: torch.ones(1, device=f"neuron:{n}"),
    lambda n: torch.ones(1).to(f"neuron:{n}"),
    lambda n: torch.neuron.synchronize(n),
    lambda n: torch.neuron.memory_allocated(n),
], ids=["torch.neuron.set_device", "torch.accelerator.set_device_index", "factory", "to", "synchronize",
        "memory_allocated"])
def test_a_device_index_out_of_range_raises_accelerator_error_as_cuda(use, restore_current_device):
    # The C++ guard raised IndexError, which `except RuntimeError` misses. CUDA raises
    # torch.AcceleratorError ("invalid device ordinal"), a RuntimeError, from torch's APIs;
    # the runtime's Python check raises the same type (Note [An invalid device is an AcceleratorError]).
    count = torch.neuron.device_count()
    with pytest.raises(torch.AcceleratorError, match=rf"Invalid device: neuron:{count}\. .*must be in \[0, {count}\)") as e:
        use(count)
    assert not isinstance(e.value, IndexError)
    assert e.value.error_code == 101  # CUDA's cudaErrorInvalidDevice
    assert torch.neuron.current_device() == 0


# -- synchronize --------------------------------------------------------------------------
def test_synchronize_and_accelerator_synchronize_drain_held_back_work():
    drained = []
    hook = drained.append
    CONTEXT.runtime.add_sync_hook(hook)
    try:
        torch.neuron.synchronize()
        torch.neuron.synchronize("neuron:1")
        torch.accelerator.synchronize()
    finally:
        CONTEXT.runtime.remove_sync_hook(hook)
    assert len(drained) == 3


def test_synchronize_rejects_a_bad_device():
    with pytest.raises(NeuronDeviceError, match="Invalid device: neuron:99"):
        torch.neuron.synchronize(99)


def test_accelerator_is_neuron():
    assert torch.accelerator.is_available()
    assert torch.accelerator.current_accelerator() == torch.device("neuron")
    assert torch.accelerator.device_count() == torch.neuron.device_count()


# -- random numbers -------------------------------------------------------------------------
# Random numbers as TorchNeuron draws them (Note [Random ops draw from CPU's generator],
# csrc/runtime/generator.cpp): random ops on neuron continue torch's default CPU generator;
# a device's own generator is a seed and an offset that no op draws from.
def test_device_random_numbers_continue_the_cpu_generators_sequence():
    # TorchNeuron's test pattern: seed, draw on CPU, then a draw on neuron is CPU's next draw.
    t = torch.zeros(2, 3, device="neuron")
    torch.manual_seed(0)
    torch.randn(5)
    expected = [torch.randn(2, 3), torch.rand(2, 3), torch.empty(2, 3).bernoulli_(0.4),
                torch.randint(0, 9, (2, 3)), torch.randperm(7), torch.empty(2, 3).normal_(1.0, 2.0)]
    torch.manual_seed(0)
    torch.randn(5)
    got = [torch.randn_like(t), torch.rand(2, 3, device="neuron"), torch.empty_like(t).bernoulli_(0.4),
           torch.randint(0, 9, (2, 3), device="neuron"), torch.randperm(7, device="neuron"),
           torch.empty_like(t).normal_(1.0, 2.0)]
    for e, g in zip(expected, got):
        assert g.device.type == "neuron" and torch.equal(g.cpu(), e)


def test_device_random_numbers_move_the_cpu_generator_as_cpu_draws_would():
    torch.manual_seed(5)
    torch.rand(3, device="neuron")
    torch.nn.functional.dropout(torch.ones(4, 4, device="neuron"), 0.5)
    after_neuron = torch.randn(4)
    torch.manual_seed(5)
    torch.rand(3)
    torch.nn.functional.dropout(torch.ones(4, 4), 0.5)
    assert torch.equal(after_neuron, torch.randn(4))


def test_torch_manual_seed_reproduces_device_random_numbers_and_sets_every_device_seed():
    torch.manual_seed(3)
    a = torch.rand(4, device="neuron:0"), torch.rand(4, device="neuron:1")
    assert torch.neuron.initial_seed() == 3 and torch.neuron.get_rng_state(1)[:8].tolist() == [3] + [0] * 7
    torch.manual_seed(3)
    b = torch.rand(4, device="neuron:0"), torch.rand(4, device="neuron:1")
    assert torch.equal(a[0].cpu(), b[0].cpu()) and torch.equal(a[1].cpu(), b[1].cpu())
    assert not torch.equal(a[0].cpu(), a[1].cpu())  # one sequence, continued


def test_manual_seed_and_seed_set_the_device_generators_seed():
    torch.neuron.manual_seed(7)
    assert torch.neuron.initial_seed() == 7
    torch.neuron.manual_seed_all(8)
    assert [torch.neuron.get_rng_state(i)[0].item() for i in range(2)] == [8, 8]
    torch.neuron.seed()
    first = torch.neuron.initial_seed()
    torch.neuron.seed_all()
    assert torch.neuron.initial_seed() != first  # two 64-bit draws from os.urandom


def test_device_rng_state_is_its_seed_and_offset_in_16_bytes_and_round_trips():
    torch.neuron.manual_seed(42)
    state = torch.neuron.get_rng_state()
    assert state.dtype == torch.uint8 and state.device.type == "cpu" and state.numel() == 16
    assert int.from_bytes(bytes(state[:8].tolist()), "little") == 42 and state[8:].sum() == 0
    torch.rand(3, device="neuron")  # draws from CPU's generator: the device's state stays
    assert torch.equal(torch.neuron.get_rng_state(), state)
    torch.neuron.manual_seed(100)
    torch.neuron.set_rng_state(state)
    assert torch.neuron.initial_seed() == 42


def test_restoring_the_cpu_rng_state_replays_device_random_numbers():
    state = torch.get_rng_state()
    a = torch.randn(3, device="neuron")
    b = torch.randn(3, device="neuron")
    torch.set_rng_state(state)
    assert torch.equal(torch.randn(3, device="neuron").cpu(), a.cpu())
    assert not torch.equal(a.cpu(), b.cpu())


def test_rng_state_is_per_device():
    torch.neuron.manual_seed_all(0)
    state1 = torch.neuron.get_rng_state("neuron:1")
    torch.neuron.manual_seed(9)  # the current device's only
    assert torch.equal(torch.neuron.get_rng_state(1), state1)
    assert not torch.equal(torch.neuron.get_rng_state(0), state1)


def test_set_rng_state_rejects_a_state_of_another_size_saying_what_it_takes():
    with pytest.raises(TypeError, match="16 bytes.*torch.neuron.get_rng_state"):
        torch.neuron.set_rng_state(torch.get_rng_state())  # a CPU generator's state


def test_a_neuron_generator_draws_what_a_cpu_generator_with_its_seed_draws():
    # torch.Generator(device='neuron') needed the C++ hooks' getNewGenerator.
    g = torch.Generator(device="neuron").manual_seed(3)
    assert g.device == torch.device("neuron:0") and g.initial_seed() == 3
    cpu = torch.Generator().manual_seed(3)
    assert torch.equal(torch.randn(4, device="neuron", generator=g).cpu(), torch.randn(4, generator=cpu))
    x = torch.empty(6, device="neuron")
    assert torch.equal(x.uniform_(generator=g).cpu(), torch.empty(6).uniform_(generator=cpu))
    state = g.get_state()
    first = torch.rand(3, device="neuron", generator=g).cpu()
    g.set_state(state)
    assert torch.equal(torch.rand(3, device="neuron", generator=g).cpu(), first)
    assert torch.Generator(device="neuron:1").device == torch.device("neuron:1")


def test_set_rng_state_rejects_a_non_state_tensor():
    with pytest.raises(TypeError, match="torch.uint8 tensor returned by get_rng_state"):
        torch.neuron.set_rng_state(torch.zeros(3))


# -- memory ---------------------------------------------------------------------------------
def test_allocating_and_freeing_moves_memory_allocated_by_exactly_the_bytes():
    before = torch.neuron.memory_allocated()
    x = torch.empty(1000, dtype=torch.float32, device="neuron")
    assert torch.neuron.memory_allocated() == before + 4000
    y = torch.empty(10, dtype=torch.float64, device="neuron")
    assert torch.neuron.memory_allocated() == before + 4080
    del x
    assert torch.neuron.memory_allocated() == before + 80
    del y
    assert torch.neuron.memory_allocated() == before


def test_views_share_their_base_bytes_and_keep_them_alive():
    x = torch.zeros(256, device="neuron")
    before = torch.neuron.memory_allocated()
    views = [x[1:], x.view(16, 16), x.view(16, 16).t(), x.unsqueeze(0)]
    assert torch.neuron.memory_allocated() == before
    del x
    assert torch.neuron.memory_allocated() == before  # the views still hold the bytes
    del views
    assert torch.neuron.memory_allocated() == before - 1024


def test_memory_is_counted_on_the_tensors_device():
    before0, before1 = torch.neuron.memory_allocated(0), torch.neuron.memory_allocated(1)
    x = torch.empty(100, device="neuron:1")
    assert torch.neuron.memory_allocated(0) == before0
    assert torch.neuron.memory_allocated("neuron:1") == before1 + 400
    del x


def test_peak_memory_tracks_the_maximum_until_reset():
    base = torch.neuron.memory_allocated()
    torch.neuron.reset_peak_memory_stats()
    x = torch.empty(2000, device="neuron")
    del x
    assert torch.neuron.max_memory_allocated() == base + 8000
    torch.neuron.reset_peak_memory_stats()
    assert torch.neuron.max_memory_allocated() == base


def test_memory_stats_and_mem_get_info_agree_with_memory_allocated():
    x = torch.empty(100, device="neuron")
    stats = torch.neuron.memory_stats()
    free, total = torch.neuron.mem_get_info()
    allocated = torch.neuron.memory_allocated()
    assert stats["allocated_bytes.all.current"] == allocated
    assert stats["capacity_bytes"] == total == torch.neuron.get_device_properties().total_memory
    assert free == total - allocated
    del x


def test_memory_stats_offer_torch_neuronx_keys_beside_cudas_and_they_agree():
    # TorchNeuron's own code and tests read these keys (torch_neuronx/memory.py,
    # tests/memory/test_memory_stats.py) and got KeyError.
    torch.neuron.reset_peak_memory_stats()
    torch.neuron.reset_accumulated_memory_stats()
    stats = torch.neuron.memory_stats()
    assert stats["allocation_requests"] == stats["num_tensor_frees"] == stats["num_ooms"] == 0
    for figure in ("allocated_bytes", "reserved_bytes", "active_bytes"):
        assert set(stats[figure]) == {"current", "peak", "allocated", "freed"}
        assert stats[figure]["peak"] == stats[figure]["current"] == torch.neuron.memory_allocated()
    x = torch.empty(1024, device="neuron")  # 4096 bytes
    after = torch.neuron.memory_stats()
    assert after["allocated_bytes"]["current"] == stats["allocated_bytes"]["current"] + 4096
    assert after["allocated_bytes"]["allocated"] == 4096 and after["allocation_requests"] == 1
    del x
    freed = torch.neuron.memory_stats()
    assert freed["num_tensor_frees"] == 1 and freed["allocated_bytes"]["freed"] == 4096
    assert freed["allocated_bytes"]["peak"] == stats["allocated_bytes"]["current"] + 4096
    # CUDA's keys give the same figures
    assert freed["allocated_bytes.all.allocated"] == 4096 and freed["allocated_bytes.all.freed"] == 4096
    assert freed["allocation.all.allocated"] == 1 and freed["allocation.all.freed"] == 1
    assert freed["reserved_bytes.all.current"] == torch.neuron.memory_reserved()
    assert "allocated_bytes" not in torch.neuron.memory_stats_as_nested_dict()["allocated_bytes"]["all"]
    # reset_accumulated_memory_stats restarts the accumulated figures, as CUDA's and TorchNeuron's
    torch.neuron.reset_accumulated_memory_stats()
    reset = torch.neuron.memory_stats()
    assert (reset["allocation_requests"], reset["num_tensor_frees"], reset["allocated_bytes"]["allocated"]) == (0, 0, 0)
    assert reset["allocation.all.current"] == freed["allocation.all.current"]  # what is live stays counted


def test_memory_summary_takes_abbreviated_and_shows_torch_neuronx_table_in_full():
    # memory_summary(abbreviated=True) raised TypeError.
    full, short = torch.neuron.memory_summary(), torch.neuron.memory_summary(abbreviated=True)
    assert full.startswith(short) and len(short) < len(full)
    assert "Neuron Memory Summary, Device 0" in full and "Allocated Memory" in full
    assert "Neuron Memory Summary, Device 1" in torch.neuron.memory_summary(device=1, abbreviated=False)


def test_torch_accelerator_memory_functions_report_the_devices_own_accounting():
    # Before the C++ allocator they failed: "Allocator for neuron is not a DeviceAllocator".
    torch.accelerator.reset_peak_memory_stats()
    before = torch.accelerator.memory_allocated()
    assert before == torch.neuron.memory_allocated()
    x = torch.empty(1000, device="neuron")
    assert torch.accelerator.memory_allocated() == before + 4000
    assert torch.accelerator.max_memory_allocated() == before + 4000
    assert torch.accelerator.memory_reserved() == torch.neuron.memory_allocated()
    stats = torch.accelerator.memory_stats()
    assert stats["allocated_bytes.all.current"] == before + 4000
    assert stats["allocation.all.current"] == torch.neuron.memory_stats()["allocation.all.current"]
    del x
    assert torch.accelerator.memory_allocated() == before
    assert torch.accelerator.max_memory_allocated() == before + 4000
    torch.accelerator.reset_peak_memory_stats()
    assert torch.accelerator.max_memory_allocated() == before


def test_pinned_host_memory_comes_from_the_devices_host_allocator():
    # Footguns 1 and 2 before the C++ hooks: pin_memory=True factories raised, and
    # pin_memory() returned a copy that was never pinned.
    assert torch.empty(4, pin_memory=True).is_pinned()
    assert torch.zeros(2, 3, pin_memory=True)[1].is_pinned()  # a view into a pinned block
    x = torch.arange(5.0)
    pinned = x.pin_memory()
    assert pinned.is_pinned() and not x.is_pinned() and torch.equal(pinned, x)
    assert pinned.pin_memory() is pinned  # already pinned: itself, as on CUDA
    assert torch.equal(pinned.to("neuron", non_blocking=True).cpu(), x)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)), batch_size=2,
                                         pin_memory=True)
    assert all(batch.is_pinned() for (batch,) in loader)


def test_torch_accelerator_empty_host_cache_works_once_the_device_is_in_use():
    # It segfaulted (no host allocator registered for PrivateUse1); vLLM calls it at shutdown.
    # In a child process: a segfault would take pytest with it.
    r = run_json("""
        import torch
        x = torch.ones(3, device="neuron")
        pinned = torch.empty(256, pin_memory=True)
        torch.accelerator.empty_host_cache()
        emit({"pinned": pinned.is_pinned(), "x": x.cpu().tolist()})
    """)
    assert r == {"pinned": True, "x": [1.0, 1.0, 1.0]}


def test_empty_cache_frees_nothing_that_is_still_referenced():
    x = torch.empty(100, device="neuron")
    allocated = torch.neuron.memory_allocated()
    torch.neuron.empty_cache()
    assert torch.neuron.memory_allocated() == allocated
    del x


# -- properties ----------------------------------------------------------------------------
def test_device_name_and_properties_describe_the_configured_profile():
    profile = CONTEXT.runtime.config.profile.name
    props = torch.neuron.get_device_properties("neuron:1")
    assert props.profile == profile
    assert profile in torch.neuron.get_device_name(1) == props.name
    assert props.total_memory == CONTEXT.runtime.config.capacity_bytes
    assert props.neuron_cores == CONTEXT.runtime.config.logical_cores
    with pytest.raises(NeuronDeviceError, match="Invalid device id: neuron:42"):
        torch.neuron.get_device_properties(42)


@pytest.mark.parametrize("query", [torch.neuron.get_device_properties, torch.neuron.get_device_name,
                                   torch.neuron.get_device_capability,
                                   lambda index: torch.neuron.can_device_access_peer(0, index)],
                         ids=["get_device_properties", "get_device_name", "get_device_capability",
                              "can_device_access_peer"])
@pytest.mark.parametrize("index", [-1, 99, "neuron:99"])
def test_device_properties_of_minus_one_or_a_missing_device_raise_as_torch_cuda(query, index, restore_current_device):
    # get_device_properties(-1) returned the current device's; torch.cuda's raise
    # AssertionError("Invalid device id") for -1 and any index outside [0, device_count()).
    torch.neuron.set_device(1)
    with pytest.raises(AssertionError, match=r"Invalid (peer )?device id: neuron:(-1|99)\. It must be in \[0, ") as e:
        query(index)
    assert isinstance(e.value, NeuronDeviceError)  # a RuntimeError too


def test_device_properties_of_none_or_an_unindexed_device_are_the_current_devices(restore_current_device):
    torch.neuron.set_device(1)
    assert torch.neuron.get_device_properties() == torch.neuron.get_device_properties("neuron") \
        == torch.neuron.get_device_properties(1)


def test_bf16_and_amp_dtypes_are_supported():
    assert torch.neuron.is_bf16_supported() is True
    assert torch.bfloat16 in torch.neuron.get_amp_supported_dtype()


# -- out of memory (a 64 MiB device in a fresh process) ---------------------------------------
_OOM = """
    import torch
    def oom(fn):
        try:
            fn()
        except torch.OutOfMemoryError as e:
            return str(e)
        return None
    x = torch.ones(4, 1024, 1024, device='neuron')  # 16 MiB
    allocated = torch.neuron.memory_allocated()
    # 4 TiB: the host could not allocate it either, so this proves the check comes first
    factory = oom(lambda: torch.empty(1 << 40, device='neuron'))
    after_factory = torch.neuron.memory_allocated()
    op = oom(lambda: x.repeat(4, 1, 1))  # 64 MiB result
    after_op = torch.neuron.memory_allocated()
    x_sum = (x + 1).sum().item()  # other tensors still work...
    y = x.repeat(2, 1, 1)  # ...and a smaller allocation (32 MiB) still fits
    emit({"allocated": allocated, "factory": factory, "op": op, "after_factory": after_factory,
          "after_op": after_op, "x_sum": x_sum, "y_sum": y.sum().item(),
          "ooms": torch.neuron.memory_stats()["num_ooms"]})
"""


@pytest.fixture(scope="module")
def oom_run():
    return run_json(_OOM, env={**_DEFAULT_ENV, "NEURON_DEVICE_MEMORY": "64MiB"})


def test_factory_past_capacity_raises_oom_before_allocating_on_the_host(oom_run):
    msg = oom_run["factory"]
    assert msg is not None
    assert msg.startswith("neuron:0 out of memory. Tried to allocate 4096.00 GiB.")
    assert "total capacity of 64.00 MiB" in msg and "16.00 MiB is already allocated" in msg
    assert "NEURON_DEVICE_MEMORY" in msg
    assert oom_run["after_factory"] == oom_run["allocated"] == 16 * 1024**2


def test_factories_run_on_the_host_check_capacity_before_filling_host_memory():
    # arange, eye, linspace and randperm run CPU's kernel whole: their results were made on the
    # host first (4.3 GB of RSS for a 1 GiB device). 4 TiB or more: no host could make them,
    # so the device's OOM proves the check came first.
    out = run_json("""
        import torch
        found = {}
        for name, make in [("arange", lambda: torch.arange(1 << 40, dtype=torch.float32, device="neuron")),
                           ("eye", lambda: torch.eye(1 << 20, device="neuron")),
                           ("linspace", lambda: torch.linspace(0, 1, 1 << 40, device="neuron")),
                           ("randperm", lambda: torch.randperm(1 << 40, device="neuron"))]:
            try:
                make()
                found[name] = "made"
            except torch.OutOfMemoryError as e:
                found[name] = str(e)
        found["small"] = torch.arange(4, device="neuron").tolist()
        emit(found)
    """, env={**_DEFAULT_ENV, "NEURON_DEVICE_MEMORY": "64MiB"})
    assert out.pop("small") == [0, 1, 2, 3]
    for name, message in out.items():
        assert message.startswith("neuron:0 out of memory. Tried to allocate"), (name, message)
        assert "total capacity of 64.00 MiB" in message


def test_op_result_past_capacity_raises_oom_and_the_device_stays_usable(oom_run):
    msg = oom_run["op"]
    assert msg is not None
    assert msg.startswith("neuron:0 out of memory. Tried to allocate 64.00 MiB.")
    assert "16.00 MiB is already allocated" in msg
    assert oom_run["after_op"] == oom_run["allocated"]  # the failed result is not counted
    assert oom_run["x_sum"] == 2 * 4 * 1024 * 1024
    assert oom_run["y_sum"] == 8 * 1024 * 1024
    assert oom_run["ooms"] == 2
