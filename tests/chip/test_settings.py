"""The settings table (adaptive_eager.device.settings): every environment variable the
package reads, parsed in one place. A value it cannot use never breaks `import torch` or
CPU code, and the first use of `neuron` raises naming the variable, the value and what is
allowed; the README's table is the table's own output."""
import pathlib

import pytest

from adaptive_eager.device import settings
from adaptive_eager.device.errors import NeuronConfigError
from subproc import run_json

README = pathlib.Path(__file__).parents[2] / "README.md"

# For every variable of the table, values it must refuse: the ones a user was seen to write
# (issue 33) and the edges of each kind (a flag takes exactly 0 or 1).
BAD_VALUES = {
    "NEURON_PROFILE": ["trn9", "1"],
    "NEURON_LOGICAL_NC_CONFIG": ["3", "0", "2.5", "abc", "16"],
    "NEURON_NUM_DEVICES": ["99999999999999999999999", "100000", "0", "-1", "2.5", "many"],
    "NEURON_DEVICE_MEMORY": ["99999999999999999999999", "2.5", "0", "-1", "lots", "1PiB"],
    "NEURON_LAUNCH_OVERHEAD_US": ["nan", "inf", "-1", "abc", "1e300"],
    "NEURON_SPEND_LAUNCH_OVERHEAD": ["abc", "-1", "2.5", "yes", "2"],
    "NEURON_ASYNC_LAUNCH": ["abc", "-1", "2.5", "2"],
    "NEURON_EXECUTOR_SPIN_US": ["-1", "100001", "fast"],
    "NEURON_DEVICE_TEAM_SLEEPS": ["yes", "2", "true"],
    "NEURON_PROFILER_SOURCES": ["abc", "-1", "true"],
    "NEURON_PROJECTION": ["yes", "2", "true"],
    "NEURON_PLATFORM_TARGET_OVERRIDE": ["trn9", "abc"],
    "NEURON_ADAPTIVE_EAGER": ["banana", "2", "-1"],
    "NEURON_LAUNCH_BLOCKING": ["abc", "-1", "2.5", "on"],
    "NEURON_TRACE_CACHE_SIZE": ["0", "99999999999999999999999", "abc"],
    "NEURON_TRACE_REPEATS": ["1", "abc", "2.5"],
    "NEURON_MAX_TRACE_LEN": ["99999999999999999999999", "1", "abc"],
    "NEURON_GENERIC_TRACES": ["abc", "yes", "-1"],
    "NEURON_NATIVE_MATCH": ["abc", "yes", "-1"],
    "ADAPTIVE_EAGER_NKI": ["yes", "abc", "2"],
}


def test_every_variable_of_the_table_has_bad_values_tested_here():
    assert set(BAD_VALUES) == {s.name for s in settings.SETTINGS}


@pytest.mark.parametrize("name, value", [(n, v) for n, values in BAD_VALUES.items() for v in values])
def test_a_bad_value_raises_naming_the_variable_the_value_and_what_is_allowed(name, value):
    with pytest.raises(NeuronConfigError) as err:
        settings.check_all({name: value})
    message = str(err.value)
    setting = next(s for s in settings.SETTINGS if s.name == name)
    assert message.startswith(f"{name}="), message
    assert value in message or _as_number(value) in message, message
    assert setting.allowed in message or "it must be >= " in message, message


def _as_number(text: str) -> str:
    try:
        return str(float(text))
    except ValueError:
        return text


@pytest.mark.parametrize("name, value, expected", [
    ("NEURON_LAUNCH_BLOCKING", "1", True), ("NEURON_LAUNCH_BLOCKING", "0", False),
    ("NEURON_LAUNCH_BLOCKING", "", False), ("NEURON_LAUNCH_BLOCKING", "  ", False),  # empty: unset
    ("NEURON_ASYNC_LAUNCH", "", "auto"), ("NEURON_ASYNC_LAUNCH", "0", "0"),
    ("NEURON_ADAPTIVE_EAGER", "EAGER", "eager"), ("NEURON_ADAPTIVE_EAGER", "1", "adaptive"),
    ("NEURON_DEVICE_MEMORY", "1.5GiB", 3 * 2**29), ("NEURON_DEVICE_MEMORY", "512", 512),
    ("NEURON_NUM_DEVICES", "127", 127), ("NEURON_LOGICAL_NC_CONFIG", "4", 4),
    ("NEURON_LAUNCH_OVERHEAD_US", "0", 0.0), ("NEURON_PLATFORM_TARGET_OVERRIDE", "TRN3", "trn3"),
])
def test_good_values_and_empty_ones_read_as_documented(name, value, expected):
    assert settings.read(name, {name: value}) == expected


def test_the_readme_table_is_the_settings_table():
    assert settings.markdown_table() in README.read_text(), (
        "README's settings table differs from the table in device/settings.py; regenerate it with "
        "python -m adaptive_eager.device.settings")


_IMPORT_AND_FIRST_USE = """
    import time
    start = time.monotonic()
    import torch
    out = {"cpu": torch.ones(2).sum().item()}  # import torch worked, and CPU with it
    out["seconds"] = time.monotonic() - start
    try:
        torch.ones(2, device="neuron")
        out["neuron"] = "worked"
    except RuntimeError as exc:
        out["neuron"] = str(exc)
    emit(out)
"""


@pytest.mark.parametrize("name", sorted(BAD_VALUES))
def test_a_bad_value_of_any_variable_leaves_import_torch_and_cpu_working(name):
    # The first of each variable's bad values, in a fresh process: import torch and a CPU op
    # work within seconds (NEURON_NUM_DEVICES=99999999999999999999999 used to hang), and the
    # first neuron use raises naming the variable.
    value = BAD_VALUES[name][0]
    out = run_json(_IMPORT_AND_FIRST_USE, env={name: value}, timeout=300)
    assert out["cpu"] == 2.0
    assert out["neuron"].startswith(f"{name}="), out["neuron"]
    assert out["seconds"] < 120  # a hang, not a slow machine, would pass this


def test_a_folder_of_user_files_with_our_old_names_breaks_nothing(tmp_path):
    # A user's device.py (or dispatch.py, ...) beside their script once shadowed our
    # top-level package of that name and broke `import torch` through the autoload.
    for name in ("device", "dispatch", "engine", "config", "settings", "cli", "nki_kernels"):
        (tmp_path / f"{name}.py").write_text(f"raise SystemExit('the user\\'s {name}.py was imported')\n")
    out = run_json("""
        import os, sys
        sys.path.insert(0, os.getcwd())  # as `python script.py` puts the script's folder first
        import torch
        cpu = torch.ones(2).sum().item()
        x = torch.ones(2, device="neuron") * 3
        emit([cpu, x.tolist(), str(x.device)])
    """, cwd=tmp_path)
    assert out == [2.0, [3.0, 3.0], "neuron:0"]
