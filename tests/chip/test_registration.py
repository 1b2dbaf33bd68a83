"""Registering `neuron`: idempotent, autoloaded by `import torch` (or on `import
adaptive_eager` when autoload is off), a clear error on an unsupported torch, and pure-CPU
PyTorch keeps working with the package installed."""
import io

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import adaptive_eager.dispatch as dispatch
from adaptive_eager.dispatch import CONTEXT
from adaptive_eager.dispatch.registration import check_torch_version
from subproc import run_json


# -- idempotence --------------------------------------------------------------------------------
def test_registering_again_in_a_registered_process_changes_nothing():
    runtime, executor = CONTEXT.runtime, CONTEXT.executor
    hooks = list(runtime._sync_hooks)
    packages = len(torch.serialization._package_registry)
    accelerator_sync = torch.accelerator.synchronize
    dispatch.register()
    dispatch.register()
    assert CONTEXT.runtime is runtime and CONTEXT.executor is executor
    assert runtime._sync_hooks == hooks
    assert len(torch.serialization._package_registry) == packages
    assert torch.accelerator.synchronize is accelerator_sync
    assert (torch.ones(2, device="neuron") + 1).tolist() == [2.0, 2.0]


_FRESH = """
    import torch
    before = [torch._C._get_privateuse1_backend_name(), hasattr(torch, "neuron")]
    try:
        torch.ones(1, device="neuron")
        factory_before = "worked"
    except RuntimeError as e:
        factory_before = "RuntimeError"
    import adaptive_eager.dispatch as dispatch  # any part of the package registers the device
    imported_dispatch = hasattr(torch, "neuron")
    import adaptive_eager
    dispatch.register()
    dispatch.register()
    x = torch.ones(2, device="neuron") * 3
    emit({"before": before, "factory_before": factory_before, "after_dispatch_import": imported_dispatch,
          "after": [torch._C._get_privateuse1_backend_name(), torch.neuron.device_count()],
          "value": x.tolist(), "device": str(x.device),
          "sync_hooks": len(dispatch.CONTEXT.runtime._sync_hooks)})
"""


def test_autoload_off_leaves_neuron_unregistered_until_any_part_of_the_package_is_imported():
    r = run_json(_FRESH, env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert r["before"] == ["privateuseone", False]
    assert r["factory_before"] == "RuntimeError"
    # one namespace: importing adaptive_eager.dispatch runs adaptive_eager's __init__ first
    assert r["after_dispatch_import"] is True
    assert r["after"][0] == "neuron" and r["after"][1] >= 1
    assert (r["value"], r["device"]) == ([3.0, 3.0], "neuron:0")
    assert r["sync_hooks"] == 1


def test_importing_a_submodule_before_torch_registers_neuron():
    # Once a footgun: with `device` a package of its own, importing it first left neuron
    # unregistered (the autoload ran while it was half-imported).
    out = run_json("""
        import adaptive_eager.device
        import torch
        emit(str(torch.ones(1, device='neuron').device))
    """, env={"TORCH_DEVICE_BACKEND_AUTOLOAD": None})
    assert out == "neuron:0"


def test_import_torch_alone_registers_neuron():
    r = run_json("""
        import sys, torch
        emit([torch._C._get_privateuse1_backend_name(), str(torch.ones(1, device='neuron').device),
              "adaptive_eager" in sys.modules])
    """, env={"TORCH_DEVICE_BACKEND_AUTOLOAD": None})
    assert r == ["neuron", "neuron:0", True]


# -- torch version --------------------------------------------------------------------------------
@pytest.mark.parametrize("version", ["2.12.0", "2.14.0", "3.0.0", "2.12.1+cpu"])
def test_an_unsupported_torch_version_is_a_clear_import_error(version):
    with pytest.raises(ImportError) as err:
        check_torch_version(version)
    msg = str(err.value)
    assert f"but torch {version} is installed" in msg
    assert "supports torch 2.13" in msg and "pip install 'torch>=2.13,<2.14'" in msg


@pytest.mark.parametrize("version", ["2.13.0", "2.13.1", "2.13.0+cpu", "2.13.0a0+git1234"])
def test_supported_torch_versions_pass_the_check(version):
    check_torch_version(version)


# -- pure-CPU PyTorch keeps working (in this process, where neuron is the accelerator) -------------
def test_pin_memory_of_a_cpu_tensor_returns_an_equal_new_pinned_cpu_tensor():
    x = torch.arange(4.0)
    pinned = x.pin_memory()
    assert pinned is not x and torch.equal(pinned, x) and pinned.device.type == "cpu"
    assert x.is_pinned() is False and pinned.is_pinned() is True


def _loader(**kwargs):
    data = TensorDataset(torch.arange(8.0).view(4, 2), torch.arange(4))
    return DataLoader(data, batch_size=2, pin_memory=True, **kwargs)


def test_dataloader_with_pin_memory_iterates_cpu_data():
    batches = list(_loader())
    assert len(batches) == 2
    assert torch.equal(batches[1][0], torch.tensor([[4.0, 5.0], [6.0, 7.0]]))
    assert batches[0][1].device.type == "cpu"


def test_dataloader_pin_memory_thread_with_a_worker_process():
    # num_workers > 0 starts the pin-memory thread, which also sets the accelerator's
    # current device (torch.accelerator.set_device_index).
    batches = list(_loader(num_workers=1))
    assert [b[1].tolist() for b in batches] == [[0, 1], [2, 3]]


def test_accelerator_device_index_follows_torch_neuron():
    previous = torch.neuron.current_device()
    try:
        torch.accelerator.set_device_index(2)
        assert torch.neuron.current_device() == torch.accelerator.current_device_index() == 2
        torch.neuron.set_device(1)
        assert torch.accelerator.current_device_index() == 1
    finally:
        torch.neuron.set_device(previous)


def test_save_and_load_of_cpu_tensors_stay_plain_cpu_tensors():
    buf = io.BytesIO()
    torch.save({"w": torch.arange(3.0), "n": 5}, buf)
    for weights_only in (True, False):
        buf.seek(0)
        loaded = torch.load(buf, weights_only=weights_only)
        assert type(loaded["w"]) is torch.Tensor and loaded["w"].device.type == "cpu"
        assert torch.equal(loaded["w"], torch.arange(3.0)) and loaded["n"] == 5


# The same, in a fresh process whose only contact with the package is `import torch`.
_PURE_CPU = """
    import io, torch
    from torch.utils.data import DataLoader, TensorDataset
    out = {"accelerator": str(torch.accelerator.current_accelerator())}
    out["pinned"] = torch.ones(2).pin_memory().tolist()
    loader = DataLoader(TensorDataset(torch.arange(6.0)), batch_size=3, pin_memory=True, num_workers=1)
    out["batches"] = [b[0].tolist() for b in loader]
    buf = io.BytesIO(); torch.save(torch.arange(3), buf); buf.seek(0)
    t = torch.load(buf)
    out["loaded"] = [type(t).__name__, str(t.device), t.tolist()]
    m = torch.nn.Linear(2, 1); m(torch.ones(1, 2)).sum().backward()
    out["grad_device"] = str(m.weight.grad.device)
    emit(out)
"""


def test_pure_cpu_pytorch_keeps_working_in_a_fresh_process():
    r = run_json(_PURE_CPU, env={"TORCH_DEVICE_BACKEND_AUTOLOAD": None})
    assert r == {"accelerator": "neuron", "pinned": [1.0, 1.0],
                 "batches": [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]],
                 "loaded": ["Tensor", "cpu", [0, 1, 2]], "grad_device": "cpu"}


# -- the package's boundary with the user's process --------------------------------------------
def _installed_distribution():
    """adaptive-eager as pip installed it: not the adaptive_eager.egg-info that a build leaves
    in the source tree, which importlib.metadata finds first when the tests run from there."""
    import importlib.metadata

    installed = [d for d in importlib.metadata.distributions(name="adaptive-eager") if d.read_text("INSTALLER")]
    assert len(installed) == 1, installed
    return installed[0]


def _top_level_names_installed() -> set[str]:
    """The top-level import names the adaptive-eager distribution puts on sys.path: those it
    declares, its files', and, for an editable install, the names its import finder serves."""
    import ast

    dist = _installed_distribution()
    names = set((dist.read_text("top_level.txt") or "").split())
    for f in dist.files:
        top = f.parts[0]
        if top == ".." or top.endswith(".dist-info") or top == "__pycache__":  # scripts, metadata
            continue
        if top.startswith("__editable__"):  # setuptools' finder: MAPPING says what it serves
            if f.suffix == ".py":
                tree = ast.parse(f.locate().read_text())
                mapping = next(node.value for node in tree.body if isinstance(node, ast.AnnAssign)
                               and getattr(node.target, "id", None) == "MAPPING")
                names |= {name.split(".")[0] for name in ast.literal_eval(mapping)}
            continue
        names.add(top.removesuffix(".py"))
    return names


def test_the_distribution_installs_no_top_level_name_but_the_package_and_its_autoload():
    # Generic names at the top (device, dispatch) once shadowed, and were shadowed by, users' files.
    assert _top_level_names_installed() == {"adaptive_eager", "_adaptive_eager_autoload"}
