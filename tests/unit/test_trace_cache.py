"""_TraceCache: the LRU of traces and its two indexes by first op (executor.py).

Traces are built as the engine builds them: protos of ops that really ran, then build_trace
over history entries (position, proto, producers).
"""
import torch

from adaptive_eager.dispatch import classify
from adaptive_eager.engine.executor import _TraceCache
from adaptive_eager.engine.record import OpRecord
from adaptive_eager.engine.trace import build_proto, build_trace

aten = torch.ops.aten


def proto_of(func, *args):
    rec = OpRecord.from_call(func, args, {})
    return build_proto(classify(func), rec, func(*args), args, {})


def protos(shape=(4,)):
    """Protos of unary ops on a tensor of `shape`, by name."""
    x = torch.randn(*shape, device="neuron")
    return {name: proto_of(getattr(aten, name).default, x) for name in ("neg", "exp", "sigmoid", "relu", "tanh")}


def trace(*ops):
    """A trace of the given protos, each reading the previous one's output."""
    entries = [(i, p, ((i - 1, 0),) if i else (None,)) for i, p in enumerate(ops)]
    return build_trace(entries)


def indexed(cache, t):
    """The lists t is indexed in: by its first signature and by its first op."""
    first = t.protos[0]
    return cache.by_start.get(first.signature, []), cache.by_first_op.get(first.info.op, [])


def test_added_trace_is_cached_and_indexed_by_its_first_op():
    p = protos()
    cache = _TraceCache(8)
    t = trace(p["neg"], p["exp"])
    cache.add(t)
    assert cache[t.key] is t
    assert cache.by_start[p["neg"].signature] == [t]
    assert cache.by_first_op[aten.neg.default] == [t]
    assert aten.exp.default not in cache.by_first_op  # only the first op starts a trace


def test_traces_that_start_alike_are_tried_longest_first():
    p = protos()
    cache = _TraceCache(8)
    short, long, mid = trace(p["neg"], p["exp"]), trace(p["neg"], p["exp"], p["relu"], p["tanh"]), \
        trace(p["neg"], p["sigmoid"], p["relu"])
    for t in (short, long, mid):
        cache.add(t)
    assert cache.by_start[p["neg"].signature] == [long, mid, short]
    assert cache.by_first_op[aten.neg.default] == [long, mid, short]


def test_same_first_op_on_other_sizes_shares_the_op_index_only():
    # The fast start looks traces up by op before describing the call; the slow path by signature.
    small, big = protos((4,)), protos((8, 2))
    cache = _TraceCache(8)
    a, b = trace(small["neg"], small["exp"]), trace(big["neg"], big["exp"], big["relu"])
    cache.add(a)
    cache.add(b)
    assert cache.by_start[small["neg"].signature] == [a]
    assert cache.by_start[big["neg"].signature] == [b]
    assert cache.by_first_op[aten.neg.default] == [b, a]


def test_least_recently_used_trace_is_evicted_and_unindexed():
    p = protos()
    cache = _TraceCache(2)
    first, second = trace(p["neg"], p["exp"]), trace(p["neg"], p["relu"], p["tanh"])
    cache.add(first)
    cache.add(second)
    cache.get(first.key)  # the engine touches a trace each time it starts matching it
    third = trace(p["sigmoid"], p["exp"])
    cache.add(third)
    assert second.key not in cache and first.key in cache and third.key in cache
    assert indexed(cache, second) == ([first], [first])  # its start is still first's
    assert cache.by_first_op[aten.sigmoid.default] == [third]


def test_without_a_touch_the_oldest_trace_is_evicted():
    p = protos()
    cache = _TraceCache(2)
    first, second, third = trace(p["neg"], p["exp"]), trace(p["exp"], p["neg"]), trace(p["relu"], p["tanh"])
    for t in (first, second, third):
        cache.add(t)
    assert first.key not in cache and second.key in cache and third.key in cache
    assert all(first not in starts for starts in (*cache.by_start.values(), *cache.by_first_op.values()))


def test_demoted_trace_goes_behind_the_others_that_start_alike():
    # Note [A diverging trace yields its start]
    p = protos()
    cache = _TraceCache(8)
    long, mid, short = trace(p["neg"], p["exp"], p["relu"]), trace(p["neg"], p["sigmoid"]), trace(p["neg"], p["tanh"])
    for t in (long, mid, short):
        cache.add(t)
    cache.demote(long)
    assert indexed(cache, long) == ([mid, short, long], [mid, short, long])
    assert long.key in cache  # demoted, not dropped


def test_demoting_a_trace_that_starts_alone_changes_nothing():
    p = protos()
    cache = _TraceCache(8)
    alone, other = trace(p["neg"], p["exp"]), trace(p["relu"], p["tanh"], p["exp"])
    cache.add(alone)
    cache.add(other)
    cache.demote(alone)
    assert indexed(cache, alone) == ([alone], [alone])
    assert indexed(cache, other) == ([other], [other])


def test_demoting_an_evicted_trace_does_not_put_it_back():
    p = protos()
    cache = _TraceCache(8)
    a, b = trace(p["neg"], p["exp"], p["relu"]), trace(p["neg"], p["tanh"])
    cache.add(a)
    cache.add(b)
    cache.remove(a)
    cache.demote(a)
    assert indexed(cache, a) == ([b], [b])


def test_removed_trace_leaves_the_cache_and_both_indexes():
    p = protos()
    cache = _TraceCache(8)
    keep, drop = trace(p["neg"], p["exp"], p["relu"]), trace(p["neg"], p["exp"])
    cache.add(keep)
    cache.add(drop)
    cache.remove(drop)
    assert drop.key not in cache and len(cache) == 1
    assert indexed(cache, keep) == ([keep], [keep])


def test_removing_a_trace_that_is_not_cached_is_harmless():
    p = protos()
    cache = _TraceCache(8)
    cached, stranger = trace(p["neg"], p["exp"]), trace(p["neg"], p["relu"])
    cache.add(cached)
    cache.remove(stranger)
    cache.remove(stranger)
    assert cache[cached.key] is cached and indexed(cache, cached) == ([cached], [cached])


def test_traces_of_the_same_ops_and_dataflow_share_a_key():
    # _cache_unit checks `t.key in cache` before adding: a re-found unit is not cached twice.
    p = protos()
    assert trace(p["neg"], p["exp"]).key == trace(p["neg"], p["exp"]).key
    # Dataflow is part of the key: exp reading neg's output is another trace than exp
    # reading an outside tensor.
    outside = build_trace([(0, p["neg"], (None,)), (1, p["exp"], (None,))])
    assert outside.key != trace(p["neg"], p["exp"]).key


def test_evicting_a_stale_trace_evicts_the_one_cached_under_its_key_from_the_indexes_too():
    # A match held `old` when it was evicted; the same ops were adopted again as `new`; retiring
    # `old` (its key: Note [A trace that keeps diverging retires]) must not leave `new` entered
    # (indexed) with no place in the cache, to be entered and retired again and again.
    p = protos()
    cache = _TraceCache(8)
    old, new = trace(p["neg"], p["exp"]), trace(p["neg"], p["exp"])
    assert old.key == new.key and old is not new
    cache.add(old)
    cache.remove(old)
    cache.add(new)
    cache.remove(old)
    assert new.key not in cache
    assert indexed(cache, new) == ([], [])
