"""Finding the repeating unit of the op stream, incrementally, without markers.

Each op is one interned key. For every live candidate period p we keep the run length of
positions t with key[t] == key[t - p]; candidates are seeded from the last K positions of
the current key. When a run reaches (repeats - 1) * p, the last p ops have been seen
`repeats` times in a row: the period fires (once; again only where the engine asks,
fire_again). The cost per op is O(K + live periods), independent of how long the window is.

It runs in C++ (device/csrc/engine/period_detector.cpp): it sees every op while the engine
records or detects, twice (exact and size-erased keys), and its Python form cost ~2 us a push.
"""
from __future__ import annotations

from adaptive_eager.device import native

PeriodDetector = native.PeriodDetector
_K = native.PERIOD_DETECTOR_RECENT  # recent positions kept per key

__all__ = ["PeriodDetector"]
