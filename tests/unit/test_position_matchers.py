"""A trace position's generated matcher, against the signature it was generated from.

A proto is built as the engine builds it (OpRecord.from_call, the op run, build_proto), and
compile_matcher turns it into straight-line checks. The matcher must accept exactly the
calls whose OpRecord signature equals the proto's: accepting more would replay a trace on
tensors of another layout; accepting less costs a divergence every step.
"""
import pytest
import torch

from adaptive_eager.dispatch import classify
from adaptive_eager.engine.matchers import compile_matcher
from adaptive_eager.engine.record import OpRecord, signature_difference
from adaptive_eager.engine.trace import build_proto

aten = torch.ops.aten


def proto_of(func, *args, **kwargs):
    """Run func once and describe it, as the engine does for an op it recorded."""
    rec = OpRecord.from_call(func, args, kwargs)
    out = func(*args, **kwargs)
    return build_proto(classify(func), rec, out, args, kwargs)


def signature(func, *args, **kwargs):
    return OpRecord.from_call(func, args, kwargs).signature


def neuron(*shape, dtype=torch.float32, device="neuron"):
    return torch.randn(*shape, device=device).to(dtype)


# (id, recorded call, other call, whether the other call is the same position): each row
# is checked against the matcher and against signature equality.
CASES = [
    # tensors: by metadata, never by data
    ("other_tensors_same_layout", lambda: (aten.add.Tensor, (neuron(2, 3), neuron(2, 3)), {"alpha": 0.5}),
     lambda: (aten.add.Tensor, (neuron(2, 3), neuron(2, 3)), {"alpha": 0.5}), True),
    ("other_shape", lambda: (aten.neg.default, (neuron(2, 3),), {}),
     lambda: (aten.neg.default, (neuron(3, 2),), {}), False),
    ("other_dtype", lambda: (aten.neg.default, (neuron(2, 3),), {}),
     lambda: (aten.neg.default, (neuron(2, 3, dtype=torch.float64),), {}), False),
    ("same_shape_other_strides", lambda: (aten.neg.default, (neuron(3, 3),), {}),
     lambda: (aten.neg.default, (neuron(3, 3).t(),), {}), False),
    ("other_storage_offset", lambda: (aten.neg.default, (neuron(4),), {}),
     lambda: (aten.neg.default, (neuron(5)[1:],), {}), False),
    ("other_neuron_device", lambda: (aten.neg.default, (neuron(4),), {}),
     lambda: (aten.neg.default, (neuron(4, device="neuron:1"),), {}), False),
    ("cpu_tensor_for_neuron_tensor", lambda: (aten.add.Tensor, (neuron(4), neuron(4)), {}),
     lambda: (aten.add.Tensor, (neuron(4), torch.randn(4)), {}), False),
    ("parameter_for_tensor", lambda: (aten.neg.default, (neuron(4),), {}),
     lambda: (aten.neg.default, (torch.nn.Parameter(neuron(4)),), {}), True),
    # Note [Lifted scalars]: floats by type, their value bound per call
    ("lifted_float_other_value", lambda: (aten.add.Tensor, (neuron(4), neuron(4)), {"alpha": 0.5}),
     lambda: (aten.add.Tensor, (neuron(4), neuron(4)), {"alpha": -2.0}), True),
    ("float_list_other_values", lambda: (aten._foreach_add.ScalarList, ([neuron(2), neuron(3)], [0.1, 0.2]), {}),
     lambda: (aten._foreach_add.ScalarList, ([neuron(2), neuron(3)], [0.3, 0.4]), {}), True),
    ("int_for_lifted_float", lambda: (aten.add.Tensor, (neuron(4), neuron(4)), {"alpha": 0.5}),
     lambda: (aten.add.Tensor, (neuron(4), neuron(4)), {"alpha": 1}), False),
    ("keyword_left_out", lambda: (aten.add.Tensor, (neuron(4), neuron(4)), {"alpha": 0.5}),
     lambda: (aten.add.Tensor, (neuron(4), neuron(4)), {}), False),
    # structural arguments: by value, bools apart from ints
    ("other_int_scalar", lambda: (aten.add.Tensor, (neuron(4), 1), {}),
     lambda: (aten.add.Tensor, (neuron(4), 2), {}), False),
    ("other_int_list", lambda: (aten.sum.dim_IntList, (neuron(4, 6), [0], True), {}),
     lambda: (aten.sum.dim_IntList, (neuron(4, 6), [1], True), {}), False),
    ("same_int_list", lambda: (aten.sum.dim_IntList, (neuron(4, 6), [0], True), {}),
     lambda: (aten.sum.dim_IntList, (neuron(4, 6), [0], True), {}), True),
    ("other_bool", lambda: (aten.sum.dim_IntList, (neuron(4, 6), [0], True), {}),
     lambda: (aten.sum.dim_IntList, (neuron(4, 6), [0], False), {}), False),
    ("int_for_bool", lambda: (aten.sum.dim_IntList, (neuron(4, 6), [0], True), {}),
     lambda: (aten.sum.dim_IntList, (neuron(4, 6), [0], 1), {}), False),
    ("extra_argument", lambda: (aten.sum.dim_IntList, (neuron(4, 6), [0]), {}),
     lambda: (aten.sum.dim_IntList, (neuron(4, 6), [0], False), {}), False),
    ("longer_tensor_list", lambda: (aten._foreach_add.Scalar, ([neuron(2), neuron(3)], 0.5), {}),
     lambda: (aten._foreach_add.Scalar, ([neuron(2), neuron(3), neuron(3)], 0.5), {}), False),
    # Note [CPU scalar tensors]: keyed by dtype only
    ("cpu_scalar_other_value", lambda: (aten.mul.Tensor, (neuron(4), torch.tensor(3.0)), {}),
     lambda: (aten.mul.Tensor, (neuron(4), torch.tensor(7.0)), {}), True),
    ("cpu_scalar_other_dtype", lambda: (aten.mul.Tensor, (neuron(4), torch.tensor(3.0)), {}),
     lambda: (aten.mul.Tensor, (neuron(4), torch.tensor(3.0, dtype=torch.float64)), {}), False),
    ("cpu_vector_for_cpu_scalar", lambda: (aten.mul.Tensor, (neuron(4), torch.tensor(3.0)), {}),
     lambda: (aten.mul.Tensor, (neuron(4), torch.tensor([3.0])), {}), False),
    ("neuron_scalar_for_cpu_scalar", lambda: (aten.mul.Tensor, (neuron(4), torch.tensor(3.0)), {}),
     lambda: (aten.mul.Tensor, (neuron(4), torch.tensor(3.0, device="neuron")), {}), False),
]


@pytest.mark.parametrize("recorded, other, same", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_matcher_accepts_exactly_the_calls_with_the_same_signature(recorded, other, same):
    func, args, kwargs = recorded()
    proto = proto_of(func, *args, **kwargs)
    match = compile_matcher(proto)
    assert match(args, kwargs, None) is True  # the recorded call itself
    func2, args2, kwargs2 = other()
    assert (signature(func2, *args2, **kwargs2) == proto.signature) is same
    assert (match(args2, kwargs2, None) is True) is same, match.source


def test_matcher_rejects_a_call_by_returning_none():
    x = neuron(2, 3)
    match = compile_matcher(proto_of(aten.add.Tensor, x, x, alpha=0.5))
    assert match((neuron(3, 2), neuron(3, 2)), {"alpha": 0.5}, None) is None


def test_matcher_does_not_hold_the_recorded_tensors():
    # A cached matcher lives as long as its trace: holding the recorded call's tensors
    # would keep a training step's activations alive.
    import weakref

    x = neuron(2, 3)
    match = compile_matcher(proto_of(aten.add.Tensor, x, x, alpha=0.5))
    ref = weakref.ref(x)
    del x
    assert ref() is None
    assert match((neuron(2, 3), neuron(2, 3)), {"alpha": 3.0}, None) is True


# -- what build_proto says about outputs (what _quietest_cut and the DeferPlan read) -------------

def test_new_output_is_described_by_its_geometry():
    x = neuron(2, 3)
    proto = proto_of(aten.mul.Tensor, x, x)
    assert proto.out_specs == (("new", (2, 3), (3, 1), 0, torch.float32, 24),)
    assert not proto.barrier and proto.plan is not None


def test_in_place_output_is_the_written_input():
    x, y = neuron(4), neuron(4)
    proto = proto_of(aten.mul_.Tensor, x, y)
    assert proto.out_specs == (("alias", 0),)
    assert not proto.barrier


def test_view_output_makes_a_barrier():
    # A plan can only hand out new storage, not a view of an input.
    proto = proto_of(aten.t.default, neuron(2, 3))
    assert proto.barrier and proto.plan is None


# -- signature_difference (what explain() says a divergence was) ---------------------------------

def test_signature_difference_names_the_ops_when_they_differ():
    x = neuron(2, 3)
    assert signature_difference(signature(aten.add.Tensor, x, x), signature(aten.sub.Tensor, x, x)) == \
        "expected aten.add.Tensor, got aten.sub.Tensor"


def test_signature_difference_is_empty_for_another_lifted_float():
    x = neuron(2, 3)
    assert signature_difference(signature(aten.add.Tensor, x, x, alpha=0.5),
                                signature(aten.add.Tensor, x, x, alpha=-7.0)) == ""


def test_signature_difference_shows_a_float_keyed_by_type_against_an_int():
    x = neuron(2, 3)
    assert signature_difference(signature(aten.add.Tensor, x, x, alpha=0.5),
                                signature(aten.add.Tensor, x, x, alpha=1)) == "expected alpha=float, got alpha=1"


def test_signature_difference_reports_the_first_argument_before_keywords():
    x = neuron(2, 3)
    got = signature(aten.add.Tensor, x.double(), x, alpha=1)
    assert signature_difference(signature(aten.add.Tensor, x, x, alpha=0.5), got) == \
        "argument 0: expected f32[2, 3] neuron:0, got f64[2, 3] neuron:0"


def test_signature_difference_shows_the_device_index_and_cpu_scalar_dtype():
    x = neuron(2, 3)
    assert signature_difference(signature(aten.add.Tensor, x, x), signature(aten.add.Tensor, x, x.to("neuron:1"))) == \
        "argument 1: expected f32[2, 3] neuron:0, got f32[2, 3] neuron:1"
    assert signature_difference(signature(aten.mul.Tensor, x, torch.tensor(2.0)),
                                signature(aten.mul.Tensor, x, torch.tensor(2.0, dtype=torch.float64))) == \
        "argument 1: expected cpu-scalar f32, got cpu-scalar f64"


# -- the same positions' guards in C++ (Note [A position's guards in C++]) -----------------------
# C++ checks the op's IValue stack; the Python matcher checks the call the route makes of that
# stack (route.cpp's to_python_call: defaults left out, a Python number for a tensor made a
# wrapped CPU scalar). native.route_call gives that call, so both see the same thing.
# Calls whose shape only a default decides.
DEFAULT_CASES = [
    ("positional_at_default_is_left_out", lambda: (aten.leaky_relu.default, (neuron(4), 0.2), {}),
     lambda: (aten.leaky_relu.default, (neuron(4), 0.01), {})),
    ("positional_other_value_is_a_lifted_float", lambda: (aten.leaky_relu.default, (neuron(4), 0.2), {}),
     lambda: (aten.leaky_relu.default, (neuron(4), 0.3), {})),
    ("left_out_positional_given_at_default", lambda: (aten.leaky_relu.default, (neuron(4),), {}),
     lambda: (aten.leaky_relu.default, (neuron(4), 0.01), {})),
    ("left_out_positional_given_otherwise", lambda: (aten.leaky_relu.default, (neuron(4),), {}),
     lambda: (aten.leaky_relu.default, (neuron(4), 0.3), {})),
    ("keyword_only_at_default", lambda: (aten.gelu.default, (neuron(4),), {"approximate": "tanh"}),
     lambda: (aten.gelu.default, (neuron(4),), {"approximate": "none"})),
    ("keyword_only_same", lambda: (aten.gelu.default, (neuron(4),), {"approximate": "tanh"}),
     lambda: (aten.gelu.default, (neuron(4),), {"approximate": "tanh"})),
    ("python_number_for_a_tensor", lambda: (aten.add.Tensor, (neuron(4), 1), {}),
     lambda: (aten.add.Tensor, (neuron(4), 2.5), {})),
    ("python_number_for_a_cpu_scalar", lambda: (aten.mul.Tensor, (neuron(4), torch.tensor(3.0, dtype=torch.float64)), {}),
     lambda: (aten.mul.Tensor, (neuron(4), 3.0), {})),
    ("cpu_scalar_for_a_python_number", lambda: (aten.mul.Tensor, (neuron(4), 3.0), {}),
     lambda: (aten.mul.Tensor, (neuron(4), torch.tensor(3.0, dtype=torch.float64)), {})),
]
GUARD_CASES = [c[:3] for c in CASES if c[0] != "int_for_bool"] + DEFAULT_CASES  # the route never makes an int a bool


@pytest.mark.parametrize("recorded, other", [c[1:3] for c in GUARD_CASES], ids=[c[0] for c in GUARD_CASES])
def test_cpp_guards_accept_exactly_the_route_calls_the_python_matcher_accepts(recorded, other):
    from adaptive_eager.device import native
    from adaptive_eager.engine.native_guards import compile_guards

    func, args, kwargs = recorded()
    route_args, route_kwargs = native.route_call(func, args, kwargs)
    proto = proto_of(func, *route_args, **route_kwargs)
    guards = compile_guards(proto)
    assert guards.supported
    assert guards.matches(func, args, kwargs)  # the recorded call itself
    func2, args2, kwargs2 = other()
    python = compile_matcher(proto)(*native.route_call(func2, args2, kwargs2), None) is True
    assert guards.matches(func2, args2, kwargs2) is python


def test_cpp_guards_refuse_another_op_and_an_unsupported_guard():
    from adaptive_eager.device import native
    from adaptive_eager.engine.native_guards import compile_guards

    x = neuron(4)
    guards = compile_guards(proto_of(aten.neg.default, x))
    assert guards.matches(aten.neg.default, (neuron(4),), {})
    assert not guards.matches(aten.abs.default, (neuron(4),), {})
    opaque = native.PositionGuards(aten.neg.default, [(("unsupported",), False)])
    assert not opaque.supported and not opaque.matches(aten.neg.default, (x,), {})


# -- a shape-generic position's guards (Note [Generic guards]) against its Python matcher ------
def _generic_position(first, second):
    """The one position of a generic trace built from two recorded calls of an op."""
    from adaptive_eager.engine.generic import build_generic_trace

    a, b = proto_of(first[0], *first[1], **first[2]), proto_of(second[0], *second[1], **second[2])
    return build_generic_trace([(0, a, ())], [(1, b, ())]).protos[0]


GENERIC_CASES = [
    # recorded at sizes 3 and 4, new_zeros' sizes (an int list) following the input's
    ("same_relation_new_size", (aten.new_zeros.default, (neuron(3, 2), [3, 2]), {}),
     (aten.new_zeros.default, (neuron(4, 2), [4, 2]), {}), (aten.new_zeros.default, (neuron(9, 2), [9, 2]), {}), True),
    ("relation_broken", (aten.new_zeros.default, (neuron(3, 2), [3, 2]), {}),
     (aten.new_zeros.default, (neuron(4, 2), [4, 2]), {}), (aten.new_zeros.default, (neuron(9, 2), [8, 2]), {}), False),
    ("constant_changed", (aten.new_zeros.default, (neuron(3, 2), [3, 2]), {}),
     (aten.new_zeros.default, (neuron(4, 2), [4, 2]), {}), (aten.new_zeros.default, (neuron(9, 3), [9, 3]), {}), False),
    ("other_rank", (aten.neg.default, (neuron(3, 2),), {}), (aten.neg.default, (neuron(4, 2),), {}),
     (aten.neg.default, (neuron(9, 2, 1),), {}), False),
    ("other_dtype", (aten.neg.default, (neuron(3, 2),), {}), (aten.neg.default, (neuron(4, 2),), {}),
     (aten.neg.default, (neuron(9, 2, dtype=torch.float64),), {}), False),
    ("stride_as_recorded", (aten.neg.default, (neuron(3, 2),), {}), (aten.neg.default, (neuron(4, 2),), {}),
     (aten.neg.default, (neuron(2, 9).t(),), {}), False),
    ("cat_of_a_growing_cache", (aten.cat.default, ([neuron(3, 2), neuron(1, 2)],), {}),
     (aten.cat.default, ([neuron(4, 2), neuron(1, 2)],), {}), (aten.cat.default, ([neuron(7, 2), neuron(1, 2)],), {}), True),
    ("softmax_other_dim", (aten._softmax.default, (neuron(3, 2), 0, False), {}),
     (aten._softmax.default, (neuron(4, 2), 0, False), {}), (aten._softmax.default, (neuron(9, 2), 1, False), {}), False),
]


@pytest.mark.parametrize("first, second, other, fits", [c[1:] for c in GENERIC_CASES], ids=[c[0] for c in GENERIC_CASES])
def test_cpp_generic_guards_bind_and_check_sizes_as_the_python_matcher_does(first, second, other, fits):
    from types import SimpleNamespace

    from adaptive_eager.device import native
    from adaptive_eager.engine.generic import compile_generic_matcher
    from adaptive_eager.engine.native_guards import compile_guards

    proto = _generic_position(first, second)
    guards = compile_guards(proto)
    assert guards.supported and guards.nsyms == proto.trace.nsyms
    pending = SimpleNamespace(syms=[None] * proto.trace.nsyms)
    python = compile_generic_matcher(proto)(*native.route_call(*other), pending) is True
    bound = guards.binds(*other, [0] * proto.trace.nsyms)
    assert python is fits and (bound is not None) is fits
    if fits:
        assert bound == pending.syms  # the same sizes bound to the same symbols
