"""Where a periodic stream is cut into traces, and how a unit is split: executor.py's helpers.

History entries are (stream position, proto, producers), producers holding per input the
(position, output slot) of the op that wrote it, or None. _quietest_cut reads only the
producers' out_specs; the unit checks read signatures (or size-erased signatures). So the
protos here are stand-ins with just those fields, except where real ops say it better.
"""
from types import SimpleNamespace

import pytest
import torch

from adaptive_eager.dispatch import classify
from adaptive_eager.engine.executor import (_copies_of_shorter, _equal_parts, _erased_repeats, _quietest_cut,
                                            _repeats_shorter_unit)
from adaptive_eager.engine.record import OpRecord
from adaptive_eager.engine.trace import build_proto

aten = torch.ops.aten

NEW = SimpleNamespace(out_specs=(("new", (4,), (1,), 0, torch.float32, 16),))
IN_PLACE = SimpleNamespace(out_specs=(("alias", 0),))


def two_periods(period: int, reads: dict, in_place=(), base: int = 100) -> list:
    """Two identical periods of history. reads[k]: op k reads the outputs of the ops that many
    positions back (across the period boundary too); ops at offsets in in_place write an
    input instead of making a new value."""
    entries = []
    for t in range(2 * period):
        k, position = t % period, base + t
        producers = tuple((position - d, 0) for d in reads.get(k, ()))
        entries.append((position, IN_PLACE if k in in_place else NEW, producers))
    return entries


# -- _quietest_cut ----------------------------------------------------------------------------
# Cut c starts the trace at op c of the period: a value op a makes and op b last reads is
# live across cuts a+1 .. b (mod the period).

def test_cut_with_fewest_values_live_across_it_is_chosen():
    # op0 reads op3 of the period before (crosses cut 0), op1 reads op0 (cut 1), op3 reads
    # op2 (cut 3): only cut 2 has nothing live across it.
    assert _quietest_cut(two_periods(4, {0: [1], 1: [1], 3: [1]}), 4) == 2


def test_value_counts_until_its_last_reader():
    # op0's value is read by op1 and op4 (live across cuts 1..4), op1's by op2 and op5
    # (cuts 2..5), and op0 reads op5 of the period before (cut 0): cuts 0, 1 and 5 are
    # equally quiet, and 1 starts the longest busy run. Counted to their first readers
    # only, cuts 3..5 would be empty and the cut would be 5, inside the dataflow.
    entries = two_periods(6, {1: [1], 4: [4], 2: [1], 5: [4], 0: [1]})
    assert _quietest_cut(entries, 6) == 1


def test_in_place_outputs_do_not_count_as_live():
    # op2's output is read by op0 of the next period (crosses cuts 3 and 0).
    reads = {1: [1], 0: [2]}
    assert _quietest_cut(two_periods(4, reads), 4) == 2
    # A parameter updated in place outlives every cut anyway: only op0 -> op1 counts.
    assert _quietest_cut(two_periods(4, reads, in_place={2}), 4) == 0


def test_values_read_more_than_a_period_later_do_not_count():
    # op3 reads op2 (cut 3 busy). op1 also reads the output of the op five back, from the
    # step before last: no intermediate of one step, and counted it would move the cut.
    assert _quietest_cut(two_periods(4, {3: [1], 1: [5]}), 4) == 2
    # Within a period a read does count: op0 reading op1's value three back (live across
    # cuts 2, 3 and 0) leaves cut 1 quietest.
    assert _quietest_cut(two_periods(4, {3: [1], 0: [3]}), 4) == 1


def test_inputs_from_outside_the_stream_are_ignored():
    entries = two_periods(4, {0: [1], 1: [1], 3: [1]})
    entries = [(pos, proto, producers + (None,)) for pos, proto, producers in entries]
    assert _quietest_cut(entries, 4) == 2


def test_tie_goes_to_the_quiet_cut_that_starts_the_longest_busy_run():
    # Cuts 0 and 2 are both quiet; after 0 one busy cut follows, after 2 three.
    # (The trace starts where its longest dataflow chain starts: a step's forward.)
    assert _quietest_cut(two_periods(6, {1: [1], 5: [3]}), 6) == 2


def test_tie_of_equally_long_busy_runs_goes_to_the_first_cut():
    # Cuts 1 and 4 are quiet, each followed by two busy cuts.
    assert _quietest_cut(two_periods(6, {3: [2], 0: [2]}), 6) == 1


def test_cut_is_an_offset_into_the_period_whatever_the_stream_position():
    reads = {0: [1], 1: [1], 3: [1]}
    assert {_quietest_cut(two_periods(4, reads, base=base), 4) for base in (0, 1, 7, 10_000)} == {2}


# -- _equal_parts -----------------------------------------------------------------------------

def test_unit_no_longer_than_a_trace_is_one_part():
    assert list(_equal_parts(7, 16)) == [0]
    assert list(_equal_parts(16, 16)) == [0]


def test_long_unit_is_split_into_the_fewest_equal_parts():
    # 9 ops, at most 4 per trace: three traces of 3 (not 4 + 4 + 1).
    assert list(_equal_parts(9, 4)) == [0, 3, 6]
    assert list(_equal_parts(17, 16)) == [0, 9]


@pytest.mark.parametrize("longest", [1, 2, 3, 5, 16])
def test_parts_are_as_few_as_possible_and_none_too_long(longest):
    for length in range(1, 60):
        starts = _equal_parts(length, longest)
        sizes = [min(s + starts.step, length) - s for s in starts]
        assert sum(sizes) == length
        assert len(sizes) == -(-length // longest)  # the fewest that fit
        assert max(sizes) <= longest
        assert max(sizes) - min(sizes) < len(sizes)  # only the last is shorter, and by little


# -- _copies_of_shorter and its two users --------------------------------------------------------

def test_copies_of_a_shorter_sequence_are_recognised():
    assert _copies_of_shorter(list("ABAB"), 2)
    assert _copies_of_shorter(list("ABCABCABC"), 1)
    assert _copies_of_shorter(list("AAAA"), 1)


def test_copies_shorter_than_the_shortest_unit_do_not_count():
    assert not _copies_of_shorter(list("ABAB"), 3)
    assert not _copies_of_shorter(list("AAAA"), 3)
    assert _copies_of_shorter(list("AAAA"), 2)  # AA AA


def test_sequences_that_are_not_whole_copies_are_not_recognised():
    assert not _copies_of_shorter(list("ABABA"), 1)  # a copy and a half
    assert not _copies_of_shorter(list("ABCABD"), 1)
    assert not _copies_of_shorter(list("A"), 1)


def _by_signature(text: str) -> list:
    return [(i, SimpleNamespace(signature=c), ()) for i, c in enumerate(text)]


def test_segment_of_repeated_steps_is_not_its_own_unit():
    # Ten training steps between two item() calls are one period; the unit is the step.
    assert _repeats_shorter_unit(_by_signature("ABCD" * 10), 4)
    assert not _repeats_shorter_unit(_by_signature("ABCDABCE"), 4)
    assert not _repeats_shorter_unit(_by_signature("ABAB"), 4)  # AB is too short to be a trace


def _add_scalar_proto(x, value):
    """The proto the engine builds for x.add_(value), from a real call."""
    func = aten.add_.Scalar
    rec = OpRecord.from_call(func, (x, value), {})
    out = func(x, value)
    return build_proto(classify(func), rec, out, (x, value), {})


def test_ops_differing_only_in_int_arguments_repeat_by_size_erased_keys():
    # `x.add_(i)` for i = 0..3: four different signatures, one size-erased op repeated.
    x = torch.zeros(4, device="neuron")
    seg = [(i, _add_scalar_proto(x, i), ()) for i in range(4)]
    assert not _repeats_shorter_unit(seg, 1)
    assert _erased_repeats(seg)


def test_segment_without_a_repeating_erased_unit_is_not_erased_repeats():
    seg = [(i, SimpleNamespace(erased=(c, None)), ()) for i, c in enumerate("ABCABD")]
    assert not _erased_repeats(seg)
    seg = [(i, SimpleNamespace(erased=(c, None)), ()) for i, c in enumerate("ABCABC")]
    assert _erased_repeats(seg)
