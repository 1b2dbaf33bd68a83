"""bench/per_op_instructions.py reads callgrind_annotate's inclusive listing into per-function
counts: the parts of its table are sums it takes from there (the valgrind run itself takes
minutes, and is the bench's, not a test's)."""
import importlib.util
import pathlib

_PATH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "per_op_instructions.py"
_spec = importlib.util.spec_from_file_location("per_op_instructions", _PATH)
per_op = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(per_op)

# Lines as callgrind_annotate 3.19 prints them (--inclusive=yes), shortened.
_ANNOTATED = """\
--------------------------------------------------------------------------------
Ir                    file:function
--------------------------------------------------------------------------------
46,498,424 (100.0%)  /tmp/python-build/Python/ceval.c:_PyEval_EvalFrameDefault [/root/lib/libpython3.11.so.1.0]
46,498,000 (99.99%)  /tmp/python-build/Python/ceval.c:_PyEval_EvalFrameDefault'2 [/root/lib/libpython3.11.so.1.0]
13,699,000 (29.46%)  ???:neuron::eager_fallback(c10::OperatorHandle const&, std::vector<c10::IValue, std::allocator<c10::IValue> >*) [/x/_C.so]
 9,866,000 (21.22%)  ???:neuron::enqueue(c10::OperatorHandle const&, std::vector<c10::IValue, std::allocator<c10::IValue> >*, std::shared_ptr<neuron::DeferPlan const>) [/x/_C.so]
 4,675,000 (10.05%)  ???:neuron::(anonymous namespace)::capture(c10::IValue const&, bool, neuron::Launch&, neuron::Entry&, unsigned long, long, bool) [/x/_C.so]
 3,000,000 ( 6.45%)  ???:neuron::(anonymous namespace)::capture(c10::IValue const&, bool, neuron::Launch&, neuron::Entry&, unsigned long, long, bool)'2 [/x/_C.so]
 2,000,000 ( 4.30%)  ???:neuron::(anonymous namespace)::capture(c10::IValue const&, bool, neuron::Launch&, neuron::Entry&, unsigned long, long, bool)'3 [/x/_C.so]
   388,000 ( 0.83%)  ???:std::deque<neuron::Entry, std::allocator<neuron::Entry> >::emplace_back<neuron::Entry>(neuron::Entry&&) [clone .isra.0] [/x/_C.so]
"""


def test_inclusive_counts_are_read_per_function_without_their_recursive_entries():
    counts = per_op.inclusive_counts(_ANNOTATED)
    assert counts["_PyEval_EvalFrameDefault"] == 46_498_424  # the outer entry; its '2 is inside it
    assert not [name for name in counts if "'2" in name or "'3" in name]
    assert per_op.part_count(counts, "neuron::eager_fallback(") == 13_699_000
    assert per_op.part_count(counts, "neuron::(anonymous namespace)::capture(") == 4_675_000
    assert per_op.part_count(counts, "neuron::enqueue(") == 9_866_000
    assert per_op.part_count(counts, "std::deque<neuron::Entry") == 388_000  # a [clone ...] suffix
    assert per_op.part_count(counts, "neuron::submit_queue(") == 0  # absent: nothing counted


def test_every_part_of_the_table_names_a_function_and_modes_it_belongs_to():
    for label, prefix, modes in per_op.PARTS:
        assert prefix.endswith("("), f"{label}: a whole name, so that enqueue( does not take enqueue_into("
        assert set(modes) <= set(per_op.MODES) - {"cpu"}
