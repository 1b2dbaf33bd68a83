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
matched while detection was paused, a backoff, an undescribable op) spoils the segment until
the next sync point, and only whole segments, from sync point to sync point, are candidates:
the tail after a gap (the rest of a decode token after its generic trace diverged) recurs at
many sizes, one exact trace each. While detection is paused the segment still takes what the
engine sees: the ops a quiet pause runs unrecorded (Note [Detection that finds nothing
pauses]: a prefill's ops are all known by its second call), and the prefix a diverging exact
trace matched (the decode step's first ops, where the prefill parts from it), so that the
trace starts where the next sighting leaves the decode step's trace, and takes the match over
(_switch_trace). Their dataflow is unknown (matched ops note no producers), so a trace
adopted here is marked `recurs_apart`, and only such a trace takes a match over on equal
signatures where its dataflow is unknown (_same_prefix); any other switch still needs equal
dataflow (loosened for all exact traces, GPT-2's tokens over five prompts in turn switched to
exact layer traces of other sizes and never settled: 23 to 363 launches a call).

Not every segment that recurs is a unit worth an exact trace. A segment whose first op starts
a shape-generic trace (executor's _generic_rival) is a piece of a loop whose sizes change, at
one size: GPT-2's generate() over five prompt lengths meets each token's exact sizes (and each
call's setup at its prompt length) again a few calls later, and exact traces of them, entered
where the generic ones should be and diverging at the next size, were news every few calls,
so detection never paused (11 to 38 launches a call, 496 of 4,416 ops matched in C++; 20 and
538 of 552 once these are left to the generic traces). A prefill is no such piece: no generic
trace starts at its first op (vLLM's decode step, where it starts, is an exact trace).

Sightings are kept as hashes of the interned keys (a collision adopts a trace seen once: a
spare trace, never a wrong value, since matching checks every op), bounded in number, and
segments in length (max_len ops).
"""
from __future__ import annotations

import collections

_SEEN_KEPT = 4096  # segment hashes remembered


class RecurringSegments:
    """The segment under way (its history entries and their interned keys); which ended
    segments were seen before."""

    def __init__(self, repeats: int, min_len_between_syncs: int, max_len: int):
        self.repeats = repeats
        self.min_len_between_syncs = min_len_between_syncs  # a segment from one sync point to the next
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
        if not entries or not after_cut or len(entries) < self.min_len_between_syncs:
            # Only whole segments, from sync point to sync point: a tail after a gap (the
            # rest of a token after its generic trace diverged) recurs at many sizes, one
            # exact trace each, entered where they differ (GPT-2's generate: a new 9-op trace
            # every few calls, and detection never paused).
            return None
        sighting = hash(tuple(keys))
        count = self._seen.pop(sighting, 0) + 1
        self._seen[sighting] = count
        if len(self._seen) > _SEEN_KEPT:
            self._seen.popitem(last=False)
        return entries if count >= self.repeats else None
