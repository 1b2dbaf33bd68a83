"""RecurringSegments alone (Note [Segments that recur apart]): which segments between sync
points are trusted, at what distance, and what breaks a segment."""
from adaptive_eager.engine.segments import RecurringSegments


def feed(segments: RecurringSegments, text: str, start: int = 0, skip: str = "") -> list[str]:
    """'|' is a sync point, a letter an op (its key); letters in `skip` take a position
    without being pushed (a gap). The segments trusted, as text, at each cut."""
    trusted = []
    for position, c in enumerate(text, start):
        if c == "|":
            entries = segments.cut(position)
            if entries is not None:
                trusted.append("".join(chr(key) for _, key in entries))
        elif c not in skip:
            segments.push((position, ord(c)), ord(c))
    return trusted


def make(**config) -> RecurringSegments:
    return RecurringSegments(**{"repeats": 2, "min_len_between_syncs": 2, "max_len": 64, **config})


def test_a_segment_is_trusted_at_its_second_sighting_however_far_apart():
    # The prefill (ABC) comes back after other segments (the decode steps), not in a row.
    assert feed(make(), "|ABC|xyz|xyz|xyz|ABC|") == ["xyz", "xyz", "ABC"]


def test_a_segment_seen_once_is_not_trusted():
    assert feed(make(), "|ABC|ABD|ABE|") == []


def test_three_repeats_need_three_sightings():
    assert feed(make(repeats=3), "|AB|xy|AB|xy|AB|") == ["AB"]


def test_a_gap_spoils_the_segment_until_the_next_sync_point():
    # The ops of a trace matched while detection paused are not pushed: what follows them is
    # a tail, not a segment from sync point to sync point, and never a candidate.
    assert feed(make(), "|AgBCDE|AgBCDE|", skip="g") == []
    assert feed(make(), "|AgBCDE|AgBCDE|AB|AB|", skip="g") == ["AB"]


def test_a_segment_shorter_than_the_minimum_is_never_trusted():
    assert feed(make(min_len_between_syncs=3), "|AB|AB|AB|") == []


def test_a_segment_longer_than_max_len_is_not_followed():
    long = "AB" * 40
    assert feed(make(), f"|{long}|{long}|") == []
    assert feed(make(), f"|{long}|AB|AB|") == ["AB"]


def test_forget_drops_the_segment_under_way():
    segments = make()
    feed(segments, "|AB|")
    segments.push((4, ord("A")), ord("A"))
    segments.forget()
    segments.push((5, ord("B")), ord("B"))
    assert segments.cut(6) is None  # only "B", after a gap


# -- _same_prefix: which trace may take a match over (executor.py) ----------------------------------

def _handover_traces():
    """The trace being matched (neg, then exp reading neg's output) and two candidates that go
    on differently after the same two ops: one adopted from a history where the first ops
    were matched by another trace (no producers noted: ()), one whose exp reads an outside
    tensor (known dataflow, another one)."""
    import torch
    from adaptive_eager.dispatch import classify
    from adaptive_eager.engine.record import OpRecord
    from adaptive_eager.engine.trace import build_proto, build_trace

    aten = torch.ops.aten
    x = torch.randn(4, device="neuron")

    def proto(func):
        rec = OpRecord.from_call(func, (x,), {})
        return build_proto(classify(func), rec, func(x), (x,), {})

    neg, exp, relu = proto(aten.neg.default), proto(aten.exp.default), proto(aten.relu.default)
    matched = build_trace([(0, neg, (None,)), (1, exp, ((0, 0),))])
    unknown = build_trace([(0, neg, ()), (1, exp, ()), (2, relu, ((1, 0),))])
    other = build_trace([(0, neg, (None,)), (1, exp, (None,)), (2, relu, ((1, 0),))])
    return matched, unknown, other


def test_only_a_trace_of_a_recurring_segment_takes_a_match_over_where_its_dataflow_is_unknown():
    from adaptive_eager.engine.executor import _same_prefix

    matched, unknown, other = _handover_traces()
    parts = matched.key.parts[:2]
    assert not _same_prefix(unknown, 2, parts)  # adopted by the period detector: dataflow must match
    unknown.recurs_apart = True
    assert _same_prefix(unknown, 2, parts)  # its first ops' producers unknown: signatures decide
    other.recurs_apart = True
    assert not _same_prefix(other, 2, parts)  # known, and not the matched trace's dataflow
