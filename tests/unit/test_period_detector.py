"""PeriodDetector alone: which period fires, when, and that its state stays bounded."""
import random

from adaptive_eager.engine.detector import _K, PeriodDetector


def keys(text: str) -> list[int]:
    """'ABCD' -> one key per letter: streams read as the op sequences they stand for."""
    return [ord(c) for c in text]


def fired(stream, **config) -> list[tuple[int, int]]:
    """(stream position, period) of every push that fired."""
    detector = PeriodDetector(**config)
    return [(i, p) for i, k in enumerate(stream) if (p := detector.push(k)) is not None]


def test_period_fires_on_the_last_op_of_the_second_sighting():
    assert fired(keys("ABCD" * 2), min_len=2, max_len=16) == [(7, 4)]


def test_period_does_not_fire_before_the_second_sighting_is_complete():
    assert fired(keys("ABCDABC"), min_len=2, max_len=16) == []


def test_a_stream_that_keeps_repeating_fires_its_period_once():
    # The engine adopts a trace when the period fires; firing again every step would re-adopt it.
    assert fired(keys("ABCD" * 5), min_len=2, max_len=16) == [(7, 4)]


def test_an_op_that_breaks_the_repetition_restarts_the_count():
    # The X spoils the second ABCD: only the two clean copies after it fire.
    assert fired(keys("ABCD" "ABCX" "ABCD" "ABCD"), min_len=2, max_len=16) == [(15, 4)]


def test_three_repeats_need_three_sightings():
    stream = keys("ABCD" * 3)
    assert fired(stream[:8], min_len=2, max_len=16, repeats=3) == []
    assert fired(stream, min_len=2, max_len=16, repeats=3) == [(11, 4)]


def test_period_shorter_than_min_len_never_fires():
    assert fired(keys("AB" * 2), min_len=3, max_len=16) == []
    assert fired(keys("AB" * 2), min_len=2, max_len=16) == [(3, 2)]


def test_multiple_of_a_unit_below_unit_min_fires_as_the_unit():
    # `c = mm(c, b)` x4 looks 1-periodic by signature, but with min_len=4 its unit is the 4 ops.
    assert fired(keys("A" * 8), min_len=4, max_len=16) == [(7, 4)]


def test_multiple_of_a_unit_at_or_above_unit_min_never_fires():
    assert fired(keys("A" * 8), min_len=4, max_len=16, unit_min=1) == []
    assert fired(keys("ABC" * 6), min_len=4, max_len=16, unit_min=3) == []
    # Without unit_min, 3 is not a possible trace, so its multiple 6 is the unit.
    assert fired(keys("ABC" * 4), min_len=4, max_len=16) == [(11, 6)]


def test_repeated_short_unit_fires_the_short_period_not_its_multiples():
    # x x x x: period 1 fires; 2 (and every later multiple) is x repeated and must not.
    assert fired(keys("x" * 12), min_len=1, max_len=16) == [(1, 1)]
    assert fired(keys("AB" * 8), min_len=2, max_len=16) == [(3, 2)]


def test_step_ending_in_a_repeated_pair_still_fires_its_whole_period():
    # DD repeats inside the step; it must not hide the step itself.
    assert fired(keys("ABCDD" * 2), min_len=1, max_len=16) == [(4, 1), (9, 5)]


def test_when_two_primitive_periods_fire_together_the_longest_is_returned():
    stream = keys("CABAB" * 2)  # 5-periodic, and its last four ops are ABAB
    assert fired(stream, min_len=2, max_len=4)[-1] == (9, 2)  # 2 fires at the last push...
    assert fired(stream, min_len=2, max_len=16)[-1] == (9, 5)  # ...and 5 wins it


def test_period_equal_to_max_len_fires_and_longer_never_does():
    unit = "ABCDEFGHIJKLMNOP"  # 16 ops
    assert fired(keys(unit * 4), min_len=2, max_len=16) == [(31, 16)]
    assert fired(keys(unit * 4), min_len=2, max_len=15) == []


def test_forget_requires_a_fresh_run_before_firing_again():
    stream = keys("ABCD" * 3)
    detector = PeriodDetector(min_len=2, max_len=16)
    assert [detector.push(k) for k in stream[:8]][-1] == 4
    detector.forget()
    # The run restarts at the next op: it fires once another whole period matched the last.
    assert [detector.push(k) for k in stream[8:]] == [None, None, None, 4]


def test_forget_with_three_repeats_needs_two_more_periods():
    stream = keys("ABCD" * 5)
    detector = PeriodDetector(min_len=2, max_len=16, repeats=3)
    assert [detector.push(k) for k in stream[:12]][-1] == 4
    detector.forget()
    assert [detector.push(k) for k in stream[12:]] == [None] * 7 + [4]


def test_longest_run_counts_how_long_the_stream_has_repeated():
    detector = PeriodDetector(min_len=2, max_len=16)
    for k in keys("ABCD" * 3):
        detector.push(k)
    assert detector.longest_run() == 8  # positions 4..11 each equal the op 4 before
    detector.forget()
    assert detector.longest_run() == 0


def test_position_counts_every_push_even_after_the_window_is_trimmed():
    detector = PeriodDetector(min_len=2, max_len=4)
    for k in range(100):
        detector.push(k)
    assert detector.position == 100


def _random_stream(alphabet: int, n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)  # fixed: the bounds below are checked on exactly this stream
    return [rng.randrange(alphabet) for _ in range(n)]


def test_live_runs_stay_bounded_on_a_long_random_stream():
    # max_len is large so that it does not bound the runs by itself: without pruning the
    # broken runs there would be hundreds.
    detector = PeriodDetector(min_len=4, max_len=1000)
    most = 0
    for k in _random_stream(alphabet=4, n=20_000):
        detector.push(k)
        most = max(most, len(detector.live_runs()))
    assert most <= 4 * _K


def test_live_runs_of_a_periodic_stream_are_its_recent_multiples():
    detector = PeriodDetector(min_len=4, max_len=1000)
    most = 0
    for i in range(20_000):
        detector.push(i % 7)
        most = max(most, len(detector.live_runs()))
    assert most <= _K
    assert sorted(detector.live_runs()) == [7 * m for m in range(1, _K + 1)]


def test_key_window_never_exceeds_two_repeats_of_the_longest_period():
    for repeats in (2, 3):
        detector = PeriodDetector(min_len=2, max_len=50, repeats=repeats)
        longest = 0
        for k in _random_stream(alphabet=3, n=5_000, seed=repeats):
            detector.push(k)
            longest = max(longest, detector.kept_keys())
            assert detector.most_recent_positions() <= _K
        assert repeats * 50 <= longest <= 2 * repeats * 50


def test_a_period_near_max_len_still_fires_after_the_window_was_trimmed():
    # Trimming drops the older half of the window; a run must still find the ops one
    # period back.
    detector = PeriodDetector(min_len=2, max_len=50)
    for k in _random_stream(alphabet=1000, n=1_000, seed=7):
        detector.push(k)
    unit = list(range(2000, 2050))  # 50 new keys
    out = [detector.push(k) for k in unit * 2]
    assert out[-1] == 50 and out[:-1] == [None] * 99


def test_a_period_asked_to_fire_again_fires_once_more_if_its_run_goes_on():
    detector = PeriodDetector(min_len=2, max_len=16)
    stream = keys("ABCD" * 6)
    got = []
    for i, k in enumerate(stream):
        p = detector.push(k)
        if p is not None:
            got.append((i, p))
            if len(got) == 1:
                detector.fire_again(p, after=8)  # two more periods
    assert got == [(7, 4), (15, 4)]


def test_a_run_broken_before_it_fires_again_does_not():
    detector = PeriodDetector(min_len=2, max_len=16)
    got = []
    for i, k in enumerate(keys("ABCD" * 2 + "ABXD" + "ABCD")):
        p = detector.push(k)
        if p is not None:
            got.append((i, p))
            detector.fire_again(p, after=8)
    assert got == [(7, 4)]
