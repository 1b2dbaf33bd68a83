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
    return RecurringSegments(**{"repeats": 2, "min_len_between_syncs": 2, "min_len": 4, "max_len": 64, **config})


def test_a_segment_is_trusted_at_its_second_sighting_however_far_apart():
    # The prefill (ABC) comes back after other segments (the decode steps), not in a row.
    assert feed(make(), "|ABC|xyz|xyz|xyz|ABC|") == ["xyz", "xyz", "ABC"]


def test_a_segment_seen_once_is_not_trusted():
    assert feed(make(), "|ABC|ABD|ABE|") == []


def test_three_repeats_need_three_sightings():
    assert feed(make(repeats=3), "|AB|xy|AB|xy|AB|") == ["AB"]


def test_a_gap_starts_the_segment_afresh():
    # The ops of a trace matched while detection paused are not pushed: what follows them
    # is a segment of its own, which needs the longer minimum of a segment not bounded by syncs.
    assert feed(make(), "|AgBCDE|AgBCDE|", skip="g") == ["BCDE"]
    assert feed(make(), "|AgBC|AgBC|", skip="g") == []


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
    assert segments.cut(6) is None  # only "B": shorter than a segment after a gap may be
