"""What the engine does with the next op: its phase.

Note [Engine phases]
~~~~~~~~~~~~~~~~~~~~
One engine, one phase at a time, changed only by the transitions in executor.py's section
"phase transitions" (`_match`, `_stop_matching`, `_back_off`, `_backed_off`):

| phase | the next op | leaves it |
|---|---|---|
| RECORDING | runs eagerly, into the history and both period detectors; a cached trace that starts with it starts a match instead | a trace starts (MATCHING); most recent ops were never seen before (BACKING_OFF) |
| MATCHING | `pending` holds a trace and how far the stream has followed it: the op is deferred if it is the trace's next; a sync point launches the prefix and matching goes on | the trace completes and launches, diverges, or an explicit sync, an interrupt or a failed issue ends the match (RECORDING, or BACKING_OFF if a backoff began meanwhile) |
| BACKING_OFF | runs eagerly, unrecorded: the stream is mostly signatures never seen, which cannot repeat (`_count_novelty`) | its ops are run (RECORDING) |

Two conditions ride along in any phase:
- an entry ahead (`_enter_at`): a trace just adopted whose first op is the one at a known
  stream position; when the stream gets there the engine starts matching it, whatever the
  phase (a periodic stream enters its step's trace at the step's first op);
- detection paused (`_steady >= _pause_after`): after a long stretch fully covered by cached
  traces, the history and the detectors are not fed (Note [When detection pauses]).
"""
from __future__ import annotations

import enum


class Phase(enum.Enum):
    RECORDING = "recording"
    MATCHING = "matching"
    BACKING_OFF = "backing off"
