"""Read a chrome trace torch.profiler exported, with its times exact.

The exported times are µs (three decimals) since the host's clock began, the machine's uptime:
past ~50 days of it a double holds such a time only to ~1 ns, the rounding checks on a trace
allow. The times are read as decimals and given relative to the trace's first event, so the
differences the checks take are exact to a double's precision of small numbers.
"""
from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path


def read_events(path: Path) -> list[dict]:
    """The trace's events, every number a float, "ts" relative to the earliest event's."""
    events = json.loads(Path(path).read_text(), parse_float=Decimal)["traceEvents"]
    base = min(e["ts"] for e in events if "ts" in e)

    def floats(value):
        if isinstance(value, Decimal):
            return float(value)
        if isinstance(value, dict):
            return {k: floats(v) for k, v in value.items()}
        return [floats(v) for v in value] if isinstance(value, list) else value

    return [{**floats(e), **({"ts": float(e["ts"] - base)} if "ts" in e else {})} for e in events]
