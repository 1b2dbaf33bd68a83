"""Finding the repeating unit of the op stream, incrementally, without markers.

Each op is one interned key. For every live candidate period p we keep the run length of
positions t with key[t] == key[t - p]; candidates are seeded from the last K positions of
the current key. When a run reaches (repeats - 1) * p, the last p ops have been seen
`repeats` times in a row: the period fires (once; again only where the engine asks,
fire_again). The cost per op is O(K + live periods), independent of how long the window is.
"""
from __future__ import annotations

_K = 8  # recent positions kept per key


class PeriodDetector:
    def __init__(self, min_len: int, max_len: int, repeats: int = 2, unit_min: int | None = None):
        self.min_len = min_len
        # A shorter period disqualifies a longer one only if it could itself become a trace:
        # `c = mm(c, b)` x4 looks 1-periodic by signature, but its unit is the 4 ops.
        self.unit_min = min_len if unit_min is None else unit_min
        self.max_len = max_len
        self.repeats = repeats
        self._keys: list[int] = []
        self._base = 0  # stream position of _keys[0]
        self._last: dict[int, list[int]] = {}
        self._runs: dict[int, int] = {}
        self._again: dict[int, int] = {}  # period -> the run length at which it fires again

    @property
    def position(self) -> int:
        """Stream position of the next key."""
        return self._base + len(self._keys)

    def push(self, key: int) -> int | None:
        """Add one op's key; returns the period that just fired (the longest primitive one), or None."""
        i = self.position
        keys, base = self._keys, self._base
        runs = {}
        for p, r in self._runs.items():
            j = i - p - base
            if j >= 0 and keys[j] == key:
                runs[p] = r + 1
        recent = self._last.get(key)
        if recent is None:
            self._last[key] = [i]
        else:
            for j in recent:
                p = i - j
                if p <= self.max_len and p not in runs:
                    runs[p] = 1
            recent.append(i)
            if len(recent) > _K:
                del recent[0]
        self._runs = runs
        keys.append(key)
        if len(keys) > 2 * self.repeats * self.max_len:
            drop = len(keys) // 2
            del keys[:drop]
            self._base += drop
        need = self.repeats - 1
        again = self._again
        fired = [p for p, r in runs.items() if (r == p * need or again and again.get(p) == r) and p >= self.min_len]
        for p in fired:
            again.pop(p, None)
        if not fired:
            return None
        # The longest primitive period: p is not a new unit if its window is a shorter unit q
        # repeated (q divides p and the window is q-periodic), or if the stream has been
        # q-periodic for all of the last p ops (q-periodic stretches fire every p; a step
        # that merely ends in a repeated pair, or shares a few ops with its start, does not).
        primitive = [p for p in fired
                     if not any(self.unit_min <= q < p and (r >= p or p % q == 0 and r >= p - q)
                                for q, r in runs.items())]
        return max(primitive) if primitive else None

    def longest_run(self) -> int:
        """The longest run of any live candidate period: how long the stream has repeated."""
        return max(self._runs.values(), default=0)

    def forget(self) -> None:
        """Drop every live run (after a disruption the stream must repeat afresh)."""
        self._runs = {}
        self._again = {}

    def fire_again(self, period: int, after: int) -> None:
        """Fire `period` once more if its run goes on for `after` more ops: the engine could not
        adopt it yet (Note [A trace that keeps diverging retires] in engine/executor.py)."""
        run = self._runs.get(period)
        if run is not None:
            self._again[period] = run + after
