"""Segments between sync points that come back, though not in a row.

Note [Segments that recur apart]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The period detector finds a unit that repeats back to back. A server's prefill does not: each
generate() call (each batch of new requests) runs one prefill step, then its decode steps,
then the next call's prefill. When the calls are short, the whole call is a period, found
after two of them; when they are long, detection has paused by the second (Note [When
detection pauses]), the divergence into the next prefill clears the history, and the period
is never seen twice: vLLM's prefill after decode ran op by op (112 launches of 129) for ever.

So the stream's natural cuts, its sync points (host reads: a server reads the sampled tokens
every step), also delimit candidates: the ops run since the last cut, when a sync point ends
them, are a segment; a segment whose exact op sequence has been seen `repeats` times (at any
distance, within the last _SEEN_KEPT segments) becomes a trace, as a segment of a period
would (executor.py's _cut_segment). Only contiguous stretches count: a gap (ops a trace
matched while detection was paused, a backoff, an undescribable op) starts the segment
afresh, so one that began after a gap is only its tail, which is what the next sighting
starts with too when it begins at the same divergence. While detection is paused the segment
still takes what the engine sees: the ops a quiet pause runs unrecorded (Note [Detection that
finds nothing pauses]: a prefill's ops are all known by its second call), and the prefix a
diverging trace matched (the decode step's first op, where the prefill parts from it), so
that the trace starts where the next sighting leaves the decode step's trace, and takes the
match over (_switch_trace). Sightings are kept as hashes of the interned keys (a collision
adopts a trace seen once: a spare trace, never a wrong value, since matching checks every
op), bounded in number, and segments in length (max_len ops).
"""
from __future__ import annotations

import collections

_SEEN_KEPT = 4096  # segment hashes remembered


class RecurringSegments:
    """The segment under way (its history entries and their interned keys); which ended
    segments were seen before."""

    def __init__(self, repeats: int, min_len_between_syncs: int, min_len: int, max_len: int):
        self.repeats = repeats
        self.min_len_between_syncs = min_len_between_syncs  # a segment from one sync point to the next
        self.min_len = min_len  # one that began after a gap
        self.max_len = max_len
        self._entries: list | None = []  # None: longer than max_len, not followed
        self._keys: list[int] = []
        self._next = 0  # the stream position that continues the segment
        self._after_cut = False  # the segment began right after a sync point
        self._seen: collections.OrderedDict = collections.OrderedDict()  # hash -> sightings

    def forget(self) -> None:
        """The stream is not followed from here (an op the history does not hold)."""
        self._entries, self._keys = [], []
        self._next = -1
        self._after_cut = False

    def push(self, entry: tuple, key: int) -> None:
        """An op (not a sync point) at stream position entry[0]: its history entry and key."""
        position = entry[0]
        if position != self._next:  # a gap: a new segment from here
            self._entries, self._keys = [], []
            self._after_cut = False
        self._next = position + 1
        if self._entries is None:
            return
        if len(self._keys) < self.max_len:
            self._entries.append(entry)
            self._keys.append(key)
        else:
            self._entries = None

    def cut(self, position: int) -> list | None:
        """A sync point at `position` ends the segment: its entries if this sighting makes
        it trusted, else None."""
        entries = self._entries if position == self._next else None
        keys, after_cut = self._keys, self._after_cut
        self._entries, self._keys, self._next, self._after_cut = [], [], position + 1, True
        if not entries or len(entries) < (self.min_len_between_syncs if after_cut else self.min_len):
            return None
        sighting = hash((after_cut, tuple(keys)))
        count = self._seen.pop(sighting, 0) + 1
        self._seen[sighting] = count
        if len(self._seen) > _SEEN_KEPT:
            self._seen.popitem(last=False)
        return entries if count >= self.repeats else None
