"""Every environment variable adaptive-eager reads: one table, one parser per kind of value.

Note [A bad setting fails at first use]: `import torch` imports us (the backend autoload), in
programs that never touch `neuron` too, so no setting is read while a module is imported.
The first use of the device (registration, at `import adaptive_eager` or the autoload) calls
`check_all()`, which parses every variable of the table; a value it cannot use raises
NeuronConfigError naming the variable, the value and what is allowed, and the autoload turns
that into a device that refuses at its first use (`_adaptive_eager_autoload`). Later reads
(`read(name)`) go through the same parser, so no module has a spelling of its own.

Every value is a string in the environment; an empty one (`NEURON_X= python ...`, common in
shell scripts) means unset. Flags take exactly 0 or 1. The README's table of settings is
`markdown_table()`'s output (tests/chip/test_settings.py holds the two together); a new
variable is a row of SETTINGS, with the kind of value it takes.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Mapping

from .errors import NeuronConfigError

# c10::DeviceIndex is an int8_t: neuron:126 is the last index a torch.device can name.
MAX_DEVICES = 127
_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "kib": 1024, "m": 1024**2, "mib": 1024**2,
               "g": 1024**3, "gib": 1024**3, "t": 1024**4, "tib": 1024**4}


@dataclasses.dataclass(frozen=True)
class Setting:
    """One environment variable: its name, its value when unset (None: the reader computes
    it, as the device count from the profile), how it is shown, and its parser."""

    name: str
    default: object
    default_text: str  # the default as the README shows it
    allowed: str  # what a value may be, in words: the README's and every error's
    meaning: str
    parse: Callable[[str, str, str], object]  # (name, stripped text, allowed) -> value

    def read(self, env: Mapping[str, str] | None = None):
        raw = (os.environ if env is None else env).get(self.name)
        if raw is None or not raw.strip():
            return self.default
        return self.parse(self.name, raw.strip(), self.allowed)


def _flag(name: str, text: str, allowed: str) -> bool:
    if text not in ("0", "1"):
        raise NeuronConfigError(f"{name}={text!r} is not a flag; {allowed}.")
    return text == "1"


def _integer(low: int, high: int):
    def parse(name: str, text: str, allowed: str) -> int:
        if not re.fullmatch(r"[+-]?[0-9]+", text):
            raise NeuronConfigError(f"{name}={text!r} is not an integer; {allowed}.")
        value = int(text)
        if not low <= value <= high:
            raise NeuronConfigError(f"{name}={value} is out of range; it must be >= {low} and <= {high}.")
        return value

    return parse


def _number(low: float, high: float):
    def parse(name: str, text: str, allowed: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise NeuronConfigError(f"{name}={text!r} is not a number; {allowed}.") from None
        if not math.isfinite(value):  # float() takes 'nan' and 'inf': every device time would be one
            raise NeuronConfigError(f"{name}={text!r} is not a finite number; {allowed}.")
        if value < low:
            raise NeuronConfigError(f"{name}={value} is negative; {allowed}." if value < 0 <= low
                                    else f"{name}={value} is out of range; {allowed}.")
        if value > high:
            raise NeuronConfigError(f"{name}={value} is out of range; {allowed}.")
        return value

    return parse


def parse_size(text: str) -> int:
    """'24GiB', '512m', '1000' (bytes) -> bytes; ValueError if it is not a whole number of bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(text)
    number, unit = m.group(1), _SIZE_UNITS[m.group(2).lower()]
    whole, _, fraction = number.partition(".")
    # Exact arithmetic: 1.5GiB is 1610612736 bytes, 2.5 is no number of bytes (not 2).
    numerator = int(whole or "0") * 10 ** len(fraction) + int(fraction or "0")
    value, remainder = divmod(numerator * unit, 10 ** len(fraction))
    if remainder:
        raise ValueError(text)
    return value


def _size(low: int, high: int):
    def parse(name: str, text: str, allowed: str) -> int:
        try:
            value = parse_size(text)
        except ValueError:
            raise NeuronConfigError(f"{name}={text!r} is not a size; {allowed}.") from None
        if not low <= value <= high:
            raise NeuronConfigError(f"{name}={text!r} is out of range; {allowed}.")
        return value

    return parse


def _choice(values: Mapping[str, object], message: str = "is not one of the values it takes"):
    def parse(name: str, text: str, allowed: str):
        key = text.lower()
        if key not in values:
            raise NeuronConfigError(f"{name}={text!r} {message}; {allowed}.")
        return values[key]

    return parse


def _lnc(name: str, text: str, allowed: str) -> int:
    value = _integer(1, 8)(name, text, allowed)
    if 8 % value:  # every profile's chip has 8 NeuronCores
        raise NeuronConfigError(f"{name}={value} must divide the 8 NeuronCores of a chip; {allowed}.")
    return value


_FLAG = "set it to 1 (on) or 0 (off)"
_PIB = 1024**5

SETTINGS: tuple[Setting, ...] = (
    # -- the device -----------------------------------------------------------------------
    Setting("NEURON_PROFILE", "trn2", "`trn2`", "use one of ['trn2', 'trn3']",
            "device profile: the chip whose figures the cost model uses",
            _choice({"trn2": "trn2", "trn3": "trn3"}, "is not a known device profile")),
    Setting("NEURON_LOGICAL_NC_CONFIG", 2, "`2`", "use 1, 2, 4 or 8",
            "NeuronCores per logical device (`neuron:N`); 8 cores per chip", _lnc),
    Setting("NEURON_NUM_DEVICES", None, "8 / logical size (4)",
            f"set it to an integer from 1 to {MAX_DEVICES}", "number of `neuron:N` devices",
            _integer(1, MAX_DEVICES)),
    Setting("NEURON_DEVICE_MEMORY", None, "24GiB on trn2, 36GiB on trn3",
            "write bytes or a number with a unit, e.g. 24GiB or 512MiB, up to 1024TiB",
            "capacity per device", _size(1, _PIB)),
    Setting("NEURON_LAUNCH_OVERHEAD_US", None, "`15`",
            "set it to microseconds from 0 to 1000000, e.g. 15",
            "modelled fixed cost of one kernel launch, µs", _number(0.0, 1e6)),
    Setting("NEURON_SPEND_LAUNCH_OVERHEAD", False, "`0`", _FLAG,
            "`1`: also spend the modelled overhead in wall-clock time", _flag),
    Setting("NEURON_ASYNC_LAUNCH", "auto", "`auto`", "use auto or 1 (yes), or 0 (never)",
            "launches on the device stream: `auto` or `1` (yes), `0` (never)",
            _choice({"auto": "auto", "1": "1", "0": "0"})),
    Setting("NEURON_EXECUTOR_SPIN_US", 200, "`200`", "set it to an integer from 0 to 100000",
            "µs the device's thread watches its empty queue before it sleeps (`0`: sleeps at once)",
            _integer(0, 100_000)),
    Setting("NEURON_DEVICE_TEAM_SLEEPS", False, "`0`", _FLAG,
            "`1`: while your thread issues, the device's OpenMP workers sleep between parallel regions "
            "(a held idle team makes libgomp spin briefly); `0`: libgomp's own spin", _flag),
    Setting("NEURON_PROFILER_SOURCES", False, "`0`", _FLAG,
            "`1`: fused launches' profiler ranges name their first and last source lines", _flag),
    Setting("NEURON_PROJECTION", False, "`0`", _FLAG,
            "`1`: the whole process in projection mode (tensors without bytes, costs as with them)", _flag),
    Setting("NEURON_PLATFORM_TARGET_OVERRIDE", None, "unset (the profile's)",
            "use one of gen2, gen3, gen4, inf2, trn1, trn2, trn3, or unset it to follow NEURON_PROFILE",
            "the NeuronCore generation NKI kernels are built for",
            _choice({n: n for n in ("trn1", "inf2", "gen2", "trn2", "gen3", "trn3", "gen4")},
                    "is not a NeuronCore target")),
    # -- the adaptive engine --------------------------------------------------------------
    Setting("NEURON_ADAPTIVE_EAGER", "adaptive", "`1`", "use 1 (adaptive, the default) or 0 (eager, one launch per op)",
            "`0`: start in eager mode (one launch per op)",
            _choice({"1": "adaptive", "adaptive": "adaptive", "0": "eager", "eager": "eager"}, "is not a mode")),
    Setting("NEURON_LAUNCH_BLOCKING", False, "`0`", _FLAG,
            "`1`: every op runs synchronously, one launch each (for debugging)", _flag),
    Setting("NEURON_TRACE_CACHE_SIZE", 256, "`256`", "set it to an integer from 1 to 1000000",
            "traces kept, least recently used evicted", _integer(1, 1_000_000)),
    Setting("NEURON_TRACE_REPEATS", 2, "`2`", "set it to an integer from 2 to 100",
            "sightings of a sequence before it becomes a trace", _integer(2, 100)),
    # The detector keeps 2 x 2 x this many ops (about 110 bytes each): 110 MB at the most.
    Setting("NEURON_MAX_TRACE_LEN", 16384, "`16384`", "set it to an integer from 2 to 262144",
            "longest trace (one launch), in ops; a repeating step up to twice as long is found "
            "and runs as the fewest traces in a row", _integer(2, 262_144)),
    Setting("NEURON_GENERIC_TRACES", True, "`1`", _FLAG,
            "`0`: exact traces only, no shape-generic ones", _flag),
    Setting("NEURON_NATIVE_MATCH", True, "`1`", _FLAG,
            "`0`: a cached trace's ops are matched in Python only, not in C++ (Note [Armed matching])", _flag),
    # -- NKI --------------------------------------------------------------------------------
    Setting("ADAPTIVE_EAGER_NKI", False, "`0`", _FLAG,
            "`1`: `import nki` gives the emulator's NKI (as `adaptive_eager.nki.install()`); only `nki`: "
            "`neuronxcc`, a package of its own, needs `adaptive_eager.nki.install_neuronxcc()`", _flag),
)
_BY_NAME = {s.name: s for s in SETTINGS}


def read(name: str, env: Mapping[str, str] | None = None):
    """The value of one variable of the table (its default when unset); NeuronConfigError
    naming the variable when its value cannot be used."""
    return _BY_NAME[name].read(env)


def check_all(env: Mapping[str, str] | None = None) -> None:
    """Parse every variable of the table: the first bad value raises (Note [A bad setting
    fails at first use])."""
    for setting in SETTINGS:
        setting.read(env)


def markdown_table() -> str:
    """The README's table of settings."""
    rows = ["| variable | default | meaning | allowed |", "|---|---|---|---|"]
    rows += [f"| `{s.name}` | {s.default_text} | {s.meaning} | {s.allowed} |" for s in SETTINGS]
    return "\n".join(rows)


if __name__ == "__main__":  # python -m adaptive_eager.device.settings: the README's table
    print(markdown_table())
