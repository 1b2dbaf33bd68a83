"""Custom device kernels (dispatch/custom_kernels.py) and the shipped ones (builtin_kernels.py).

A custom kernel is one op on the device: one launch in eager mode, one op of a fused trace
in adaptive mode, its autograd backward whatever its backward calls. The shipped
attention and RMSNorm kernels must compute exactly what CPU computes.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import adaptive_eager
from adaptive_eager.device import native
from adaptive_eager.dispatch import CONTEXT
from adaptive_eager.engine.record import record_ops

SDPBackend = torch.nn.attention.SDPBackend


# The kernels are offered to the engine by their Python kernel (native.offer): both modes.
MODES = ("eager", "adaptive")


def _launches() -> int:
    return adaptive_eager.stats().launches


def _kernel_ops(fn) -> list[str]:
    """Names of the ops fn issues on neuron (the shadow empty_strided of SDPA's choice run on CPU)."""
    with record_ops(devices=["neuron"], source=False) as rec:
        fn()
    return rec.names()


# -- the registration API -------------------------------------------------------------------

calls = {"kernel": 0, "cost": 0}


def _scale_cost(x, s):
    calls["cost"] += 1
    return {"flops": 1e9, "bytes": 3 * x.nbytes}


@adaptive_eager.custom_kernel("ck_test::scale", cost=_scale_cost)
def scale(x: Tensor, s: float) -> Tensor:
    calls["kernel"] += 1
    assert type(x) is Tensor and x.device.type == "cpu", "a custom kernel computes on host tensors"
    return x * s


scale.register_autograd(lambda ctx, g: (scale(g, ctx.s), None),
                        setup_context=lambda ctx, inputs, output: setattr(ctx, "s", inputs[1]))


@adaptive_eager.custom_kernel("ck_test::shift")
def shift(x: Tensor) -> Tensor:
    return x + 1


@pytest.fixture
def eager():
    with adaptive_eager.mode("eager"):
        yield


def test_custom_kernel_is_one_launch_and_computes_on_the_host(eager):
    x = torch.randn(6)
    xn = x.to("neuron")
    before = _launches()
    y = scale(xn, 2.5)
    assert _launches() - before == 1
    assert y.device.type == "neuron"
    assert torch.equal(y.cpu(), x * 2.5)


@adaptive_eager.custom_kernel("ck_test::jitter", random=True)
def jitter(x: Tensor) -> Tensor:
    return x + torch.rand_like(x)  # torch's default generator, on neuron too


def _jitter_draws(x):
    torch.rand(x.shape, dtype=x.dtype)  # what rand_like(x) draws: x's shape alone decides it


@adaptive_eager.custom_kernel("ck_test::jitter_deferred", random=True, draws=_jitter_draws)
def jitter_deferred(x: Tensor) -> Tensor:
    return x + torch.rand_like(x)


def _jitter_loop(kernel, device):
    torch.manual_seed(3)
    x = torch.zeros(5, device=device)
    outs, host, launches = [], [], []
    for _ in range(8):
        before = adaptive_eager.stats().launches
        outs.append(kernel(torch.rand(5, device=device) + x) * 2)
        host.append(torch.rand(2))  # a host draw after the kernel was issued
        if device != "cpu":
            torch.neuron.synchronize()
            launches.append(adaptive_eager.stats().launches - before)
    return [o.cpu() for o in outs], host, launches


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kernel", [jitter, jitter_deferred], ids=["run_at_issue", "with_draws"])
def test_random_custom_kernel_draws_cpus_numbers_in_program_order(kernel, mode):
    """Note [Deferred random ops draw at issue]: a random body draws from torch's default
    generator where the program issued it; with `draws`, adaptive mode defers it too."""
    expected = _jitter_loop(kernel, "cpu")
    with adaptive_eager.mode(mode):
        got = _jitter_loop(kernel, "neuron")
    assert all(torch.equal(g, e) for g, e in zip(got[0], expected[0]))
    assert all(torch.equal(g, e) for g, e in zip(got[1], expected[1]))
    if mode == "adaptive":  # deferred with its draws, one launch a step; else cut at the kernel
        assert (got[2][-1] == 1) == (kernel is jitter_deferred), got[2]


def test_draws_without_random_is_refused_saying_what_to_pass():
    with pytest.raises(TypeError, match="pass random=True"):
        adaptive_eager.custom_kernel("ck_test::not_random", draws=_jitter_draws)(lambda x: x)


def test_cost_hook_prices_the_launch_instead_of_bytes(eager):
    cost = CONTEXT.runtime.cost
    xn = torch.randn(64).to("neuron")
    adaptive_eager.reset_stats()
    scale(xn, 2.0)
    busy = adaptive_eager.stats().device_time_us - adaptive_eager.stats().launch_overhead_us
    assert busy == pytest.approx(cost.op_us(1e9, 3 * xn.nbytes, torch.float32))
    adaptive_eager.reset_stats()
    shift(xn)  # no hook: bytes read and written
    busy = adaptive_eager.stats().device_time_us - adaptive_eager.stats().launch_overhead_us
    assert busy == pytest.approx(cost.op_us(0, 2 * xn.nbytes, torch.float32))


def test_cost_hook_with_a_wrong_result_names_the_fix(eager):
    @adaptive_eager.custom_kernel("ck_test::bad_cost", cost=lambda x: 42)
    def bad(x: Tensor) -> Tensor:
        return x.clone()

    with pytest.raises(TypeError, match="must return a dict with the keys 'flops'"):
        bad(torch.ones(2).to("neuron"))


def test_set_cost_rejects_what_is_not_an_op():
    with pytest.raises(TypeError, match="custom_op or an OpOverload"):
        adaptive_eager.set_cost(lambda x: x, lambda x: {})
    with pytest.raises(TypeError, match="cost must be a function"):
        adaptive_eager.set_cost(shift, {"flops": 1})


def test_custom_kernel_backward_runs_its_registered_autograd(eager):
    x = torch.randn(5, requires_grad=True)
    xn = x.detach().to("neuron").requires_grad_()
    scale(xn, 3.0).sum().backward()
    scale(x, 3.0).sum().backward()
    assert torch.equal(xn.grad.cpu(), x.grad)
    assert torch.equal(xn.grad.cpu(), torch.full((5,), 3.0))


def _scale_loop(steps):
    x = torch.arange(8.0).to("neuron")
    per_step, out = [], []
    for i in range(steps):
        before = _launches()
        x = shift(scale(x, 0.5)) * 2
        out.append(x.sum())
        per_step.append(_launches() - before)
    return [v.item() for v in out], per_step


def test_custom_kernel_is_one_op_of_a_fused_trace_in_adaptive_mode():
    with adaptive_eager.mode("eager"):
        expected, eager_launches = _scale_loop(10)
    calls["kernel"] = calls["cost"] = 0
    with adaptive_eager.mode("adaptive"):
        adaptive_eager.reset_stats()
        got, launches = _scale_loop(10)
        stats = adaptive_eager.stats()
    assert got == expected
    assert eager_launches == [4] * 10
    assert stats.fused_launches > 0 and launches[-1] <= 1, launches
    assert calls["kernel"] == 10  # replayed, never run twice
    assert calls["cost"] >= 1  # fused launches price it with its hook too


@adaptive_eager.custom_kernel("ck_test::accumulate_", mutates_args=("acc",))
def accumulate_(acc: Tensor, x: Tensor) -> None:
    acc.add_(x, alpha=0.5)


def _accumulate_loop(steps):
    acc, x = torch.zeros(4).to("neuron"), torch.arange(4.0).to("neuron")
    for _ in range(steps):
        accumulate_(acc, x)
        x = x * 1.5
    return acc.cpu()


def test_mutating_custom_kernel_writes_its_input_in_eager_and_adaptive_mode():
    with adaptive_eager.mode("eager"):
        expected = _accumulate_loop(12)
    with adaptive_eager.mode("adaptive"):
        adaptive_eager.reset_stats()
        got = _accumulate_loop(12)
        fused = adaptive_eager.stats().fused_launches
    assert torch.equal(got, expected)
    assert torch.equal(expected, sum(0.5 * torch.arange(4.0) * 1.5 ** i for i in range(12)))
    assert fused > 0


# -- attention ----------------------------------------------------------------------------------

ATTENTION_CASES = {
    "causal": lambda g: {"is_causal": True},
    "bool_mask": lambda g: {"attn_mask": torch.rand(5, 5, generator=g) > 0.3},
    "float_mask": lambda g: {"attn_mask": torch.randn(5, 5, generator=g)},
    "grouped_query": lambda g: {"enable_gqa": True, "is_causal": True, "kv_heads": 1},
    "scale": lambda g: {"scale": 0.3},
}


def _qkv(kv_heads=2, seed=5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 2, 5, 4, generator=g, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, 5, 4, generator=g, requires_grad=True) for _ in range(2))
    return q, k, v


def _to_neuron(tensors):
    return [t.detach().to("neuron").requires_grad_(t.requires_grad) for t in tensors]


def _attention_case(case):
    kwargs = ATTENTION_CASES[case](torch.Generator().manual_seed(9))
    kv_heads = kwargs.pop("kv_heads", 2)
    on_neuron = {k: v.to("neuron") if isinstance(v, Tensor) else v for k, v in kwargs.items()}
    return _qkv(kv_heads), kwargs, on_neuron


FLASH_OPS = ("aten._scaled_dot_product_flash_attention_for_cpu.default",
             "aten._scaled_dot_product_flash_attention_for_cpu_backward.default")
MATH_OPS = ("neuron.attention.default", "neuron.attention_backward.default")


@pytest.mark.parametrize("backend", [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH])
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_runs_the_hosts_choice_as_one_op_each_way_and_matches_cpu_and_the_composite(case, backend, eager):
    """Where the host takes its flash kernel, neuron issues that very ATen op (it runs on the
    device's executor like any ATen op); where it takes its math path, the one-launch
    `neuron::attention`. A boolean mask first becomes 0 / -inf in one `where`, as CPU's SDPA
    converts it."""
    (q, k, v), kwargs, on_neuron = _attention_case(case)
    qn, kn, vn = _to_neuron((q, k, v))
    forward_op, backward_op = FLASH_OPS if backend == SDPBackend.FLASH_ATTENTION else MATH_OPS
    with torch.nn.attention.sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        fwd = _kernel_ops(lambda: F.scaled_dot_product_attention(qn, kn, vn, **on_neuron))
        out_n = F.scaled_dot_product_attention(qn, kn, vn, **on_neuron)
    converts_mask = case == "bool_mask" and backend == SDPBackend.FLASH_ATTENTION
    assert [n for n in fwd if n != "aten.detach.default"] == (
        ["aten.where.self"] if converts_mask else []) + [forward_op]
    assert torch.equal(out_n.cpu(), out)  # the very kernel CPU ran
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    loss = out_n.square().sum()
    bwd = _kernel_ops(lambda: torch.autograd.grad(loss, (qn, kn, vn), retain_graph=True))
    assert bwd.count(backward_op) == 1
    assert not any("bmm" in n or "softmax" in n for n in bwd), bwd
    grads_n = torch.autograd.grad(loss, (qn, kn, vn))
    for a, b in zip(grads, grads_n):
        assert torch.equal(b.cpu(), a)
    # The composite (math) decomposition agrees up to rounding, whichever kernel ran.
    with torch.nn.attention.sdpa_kernel(SDPBackend.MATH):
        composite = F.scaled_dot_product_attention(q, k, v, **kwargs)
    torch.testing.assert_close(out_n.cpu(), composite)
    for a, b in zip(torch.autograd.grad(composite.square().sum(), (q, k, v)), grads_n):
        torch.testing.assert_close(b.cpu(), a)


def test_flash_attention_runs_on_the_devices_executor_not_the_issuing_thread(eager):
    """The issuing thread keeps no OpenMP team of its own (Note [The device executor]): issuing
    an attention returns while its kernel is still running, which only the executor can do."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 8, 2048, 64, generator=g).to("neuron")
    F.scaled_dot_product_attention(q, q, q)  # the first call learns where its outputs go
    torch.neuron.synchronize()
    out = F.scaled_dot_product_attention(q, q, q)
    running = not native.device_idle()
    expected = F.scaled_dot_product_attention(*(q.cpu(),) * 3)
    assert running, "the kernel ran before issue returned"
    assert torch.equal(out.cpu(), expected)


def test_a_trace_with_attention_goes_to_the_device_stream_and_draws_nothing():
    """Note [Seeded ops that never draw]: the flash op is tagged nondeterministic_seeded but its
    CPU kernel never draws; counted as random, every trace holding an attention would run its
    launch on the issuing thread's wait instead of the device stream."""
    g = torch.Generator().manual_seed(4)
    q, w = torch.randn(1, 2, 6, 8, generator=g), torch.randn(8, 8, generator=g)
    qn, wn = q.to("neuron"), w.to("neuron")
    with adaptive_eager.mode("adaptive"):
        state = torch.get_rng_state()  # the generator neuron's random ops draw from
        for _ in range(12):
            out_n = F.scaled_dot_product_attention(qn @ wn, qn, qn, is_causal=True).relu()
        got = out_n.cpu()
        s = adaptive_eager.stats()
    assert s.stream_launches >= 4, s
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(got, F.scaled_dot_product_attention(q @ w, q, q, is_causal=True).relu())


def test_attention_forward_without_grad_is_one_launch(eager):
    qn, kn, vn = _to_neuron(t.detach() for t in _qkv())
    before = _launches()
    F.scaled_dot_product_attention(qn, kn, vn, is_causal=True)
    assert _launches() - before == 1


@pytest.mark.parametrize("backend", [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH])
def test_attention_cost_counts_two_score_matmuls_and_no_score_matrix(backend, eager):
    cost = CONTEXT.runtime.cost
    qn, kn, vn = _to_neuron(t.detach() for t in _qkv())
    adaptive_eager.reset_stats()
    with torch.nn.attention.sdpa_kernel(backend):
        F.scaled_dot_product_attention(qn, kn, vn)
    busy = adaptive_eager.stats().device_time_us - adaptive_eager.stats().launch_overhead_us
    flops = 2 * (2 * qn.numel() * kn.shape[-2])  # q @ k^T and p @ v
    # q, k, v read and the output written; the flash kernel also writes its logsumexp (one
    # float per query row) for the backward
    nbytes = 4 * qn.nbytes + (qn.numel() // qn.shape[-1] * 4 if backend == SDPBackend.FLASH_ATTENTION else 0)
    assert busy == pytest.approx(cost.op_us(flops, nbytes, torch.float32))


@pytest.mark.parametrize("case", ["causal", "bool_mask", "float_mask", "grouped_query"])
def test_attention_with_dropout_is_one_op_each_way_and_matches_cpu(case, eager):
    """With dropout the host takes the math path; the kernel draws the same mask from CPU's
    generator where the decomposition would, and its backward replays it without drawing
    again: outputs, gradients and the generator state all equal CPU's."""
    (q, k, v), kwargs, on_neuron = _attention_case(case)
    qn, kn, vn = _to_neuron((q, k, v))
    torch.manual_seed(11)
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.4, **kwargs)
    cpu_after_forward = torch.get_rng_state()
    torch.manual_seed(11)
    fwd = _kernel_ops(lambda: F.scaled_dot_product_attention(qn, kn, vn, dropout_p=0.4, **on_neuron))
    assert [n for n in fwd if n != "aten.detach.default"] == ["neuron.attention_dropout.default"]
    torch.manual_seed(11)
    out_n = F.scaled_dot_product_attention(qn, kn, vn, dropout_p=0.4, **on_neuron)
    assert torch.equal(out_n.cpu(), out)
    assert not torch.allclose(out, F.scaled_dot_product_attention(q, k, v, **kwargs)), "nothing was dropped"
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    loss = out_n.square().sum()
    after_forward = torch.get_rng_state()
    assert torch.equal(after_forward, cpu_after_forward)  # as many draws as CPU
    bwd = _kernel_ops(lambda: torch.autograd.grad(loss, (qn, kn, vn), retain_graph=True))
    assert [n for n in bwd if "attention" in n or "dropout" in n] == ["neuron.attention_dropout_backward.default"]
    for a, b in zip(grads, torch.autograd.grad(loss, (qn, kn, vn))):
        assert torch.equal(b.cpu(), a)
    assert torch.equal(torch.get_rng_state(), after_forward)  # the backward drew nothing


def test_attention_mask_that_needs_a_gradient_keeps_the_host_decomposition(eager):
    (q, k, v), mask = _qkv(), torch.randn(5, 5, requires_grad=True)
    qn, kn, vn, mn = _to_neuron((q, k, v, mask))
    out_n = F.scaled_dot_product_attention(qn, kn, vn, attn_mask=mn)
    out_n.sum().backward()
    F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum().backward()
    assert torch.equal(mn.grad.cpu(), mask.grad)


def test_attention_under_autocast_runs_the_kernel_in_bfloat16(eager):
    q, k, v = (t.detach() for t in _qkv())
    qn, kn, vn = _to_neuron((q, k, v))
    with torch.autocast("neuron", torch.bfloat16):
        names = _kernel_ops(lambda: F.scaled_dot_product_attention(qn, kn, vn, is_causal=True))
        out_n = F.scaled_dot_product_attention(qn, kn, vn, is_causal=True)
    assert FLASH_OPS[0] in names
    assert out_n.dtype == torch.bfloat16
    expected = F.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True)
    assert torch.equal(out_n.cpu(), expected)


@pytest.mark.parametrize("mode", MODES)
def test_inference_mode_runs_the_kernels_with_cpus_bits(mode):
    """inference_mode skips the autograd key, so SDPA and rms_norm reach the executor whole;
    they run our kernels there too (not the C++ decomposition, whose PrivateUse1 SDPA choice
    is always math): CPU's flash bits, one kernel op each."""
    q = torch.randn(2, 2, 5, 4)
    x, w = torch.randn(3, 4), torch.randn(4)
    qn, xn, wn = q.to("neuron"), x.to("neuron"), w.to("neuron")
    with adaptive_eager.mode(mode), torch.inference_mode():
        flash = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        with torch.nn.attention.sdpa_kernel(SDPBackend.MATH):
            math = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        assert not torch.equal(flash, math), "flash and math agree here: the test tells nothing"
        for _ in range(6):  # adaptive mode: also once the step is a fused trace
            out_n = F.scaled_dot_product_attention(qn, qn, qn, is_causal=True)
            norm_n = F.rms_norm(xn, (4,), wn)
            assert torch.equal(out_n.cpu(), flash)
            assert torch.equal(norm_n.cpu(), F.rms_norm(x, (4,), w))
        if mode == "eager":  # one launch each (record_ops sees only the outer op here)
            before = _launches()
            F.scaled_dot_product_attention(qn, qn, qn, is_causal=True)
            F.rms_norm(xn, (4,), wn)
            assert _launches() - before == 2



@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dropout_p", [0.0, 0.4], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("needs_grad", ["query", "key", "value", "all"])
def test_attention_with_a_2d_query_gives_cpus_bits_whichever_input_needs_a_gradient(needs_grad, dropout_p, mode):
    """A 2-D query against 3-D key and value takes the math path, where matmul folds the batch
    into one mm when the 2-D side requires a gradient and takes bmm otherwise: other bits. The
    kernels compute with the flags CPU's graph carries (Note [SDPA's math path reads
    requires_grad]); they computed as if nothing, then as if everything, needed a gradient."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(5, 4, generator=g), torch.randn(3, 6, 4, generator=g), torch.randn(3, 6, 4, generator=g)
    flags = {"query": (True, False, False), "key": (False, True, False), "value": (False, False, True),
             "all": (True, True, True)}[needs_grad]

    def run(device):
        inputs = [t.to(device, copy=True).requires_grad_(f) for t, f in zip((q, k, v), flags)]
        torch.manual_seed(3)
        out = F.scaled_dot_product_attention(*inputs, dropout_p=dropout_p)
        out.square().sum().backward()
        return [out.detach()] + [t.grad for t in inputs if t.requires_grad]

    expected = run("cpu")
    with adaptive_eager.mode(mode):
        adaptive_eager.reset_stats()
        for _ in range(6):  # adaptive: also replayed in a fused trace
            for a, b in zip(expected, run("neuron")):
                assert torch.equal(b.cpu(), a), f"{(b.cpu() - a).abs().max()} from CPU's"
        if mode == "adaptive":
            assert adaptive_eager.stats().trace_hits > 0, "no replay: the fused trace went unchecked"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path", ["math", "math_with_dropout", "flash"])
def test_attention_output_edited_in_place_then_backward_behaves_as_on_cpu(path, mode):
    """CPU's math path saves no output for its backward, so editing the output in place and then
    running backward works; its flash kernel saves the output, and autograd refuses. The math
    kernels save only their inputs (neuron::attention once saved its output too, and refused
    where CPU works)."""
    g = torch.Generator().manual_seed(6)
    shape = (1, 2, 5, 4) if path == "flash" else (2, 5, 4)
    q, k, v = (torch.randn(*shape, generator=g) for _ in range(3))
    dropout_p = 0.3 if path == "math_with_dropout" else 0.0

    def run(device):
        inputs = [t.to(device, copy=True).requires_grad_() for t in (q, k, v)]
        torch.manual_seed(1)
        out = F.scaled_dot_product_attention(*inputs, dropout_p=dropout_p)
        out.mul_(2)
        out.square().sum().backward()
        return [t.grad for t in inputs]

    with adaptive_eager.mode(mode):
        if path == "flash":
            expected = _cpu_error(lambda: run("cpu"))
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                run("neuron")
            assert "output 0 of ScaledDotProductFlashAttentionForCpu" in expected
            return
        expected = run("cpu")
        for _ in range(4):  # adaptive: also replayed in a fused trace
            for a, b in zip(expected, run("neuron")):
                assert torch.equal(b.cpu(), a)


def _cpu_error(fn) -> str:
    with pytest.raises(RuntimeError) as info:
        fn()
    return str(info.value)


SDPA_REFUSALS = {  # name: (query, key, value, mask), made on CPU; "neuron" marks what moves there
    "float16_key": lambda: (torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4).half(), torch.randn(1, 2, 5, 4).half(),
                            None),
    "bfloat16_key": lambda: (torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4).bfloat16(),
                             torch.randn(1, 2, 5, 4).bfloat16(), None),
    "float16_value_with_grouped_query": lambda: (torch.randn(1, 4, 5, 4), torch.randn(1, 2, 5, 4),
                                                 torch.randn(1, 2, 5, 4).half(), None),
    "1d_key": lambda: (torch.randn(1, 2, 5, 4), torch.randn(4), torch.randn(1, 2, 5, 4), None),
    "1d_query": lambda: (torch.randn(4), torch.randn(5, 4), torch.randn(5, 4), None),
    "integer_mask": lambda: (torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4),
                             torch.ones(5, 5, dtype=torch.int64)),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(SDPA_REFUSALS))
def test_attention_refuses_what_cpu_refuses_with_cpus_error(case, mode):
    """Neuron's SDPA kernel replaces the composite whose body makes CPU's input checks, so it
    makes them itself, in CPU's words (Note [SDPA's input checks]): a float32 query with a half
    key ran (the math path promoted), a 1-D key raised IndexError."""
    q, k, v, mask = SDPA_REFUSALS[case]()
    kwargs = {"enable_gqa": True} if "grouped" in case else {}
    expected = _cpu_error(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs))
    on_neuron = [t if t is None else t.to("neuron") for t in (q, k, v, mask)]
    with adaptive_eager.mode(mode):
        for requires_grad in (False, True):  # the autograd kernel, and the one below it
            qn = on_neuron[0].detach().requires_grad_(requires_grad)
            with pytest.raises(RuntimeError) as info:
                F.scaled_dot_product_attention(qn, *on_neuron[1:3], attn_mask=on_neuron[3], **kwargs)
            assert str(info.value) == expected
        with torch.inference_mode(), pytest.raises(RuntimeError) as info:
            F.scaled_dot_product_attention(*on_neuron[:3], attn_mask=on_neuron[3], **kwargs)
        assert str(info.value) == expected


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("on_host", ["query", "key_and_value"])
def test_attention_between_host_and_device_tensors_raises_cpus_device_error(on_host, mode):
    """CPU's SDPA refuses inputs on two devices before any kernel runs; a CPU query with neuron
    key and value reached the device's kernel (Note [SDPA's input checks])."""
    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    if on_host == "query":
        k, v = k.to("neuron"), v.to("neuron")
        devices = "query.device: cpu key.device: neuron:0 and value.device: neuron:0"
    else:
        q = q.to("neuron")
        devices = "query.device: neuron:0 key.device: cpu and value.device: cpu"
    expected = f"Expected query, key, and value to have the same device type, but got {devices} instead."
    with adaptive_eager.mode(mode):
        for kwargs in ({}, {"dropout_p": 0.3}, {"enable_gqa": True}):  # flash and math alike
            with pytest.raises(RuntimeError) as info:
                F.scaled_dot_product_attention(q, k, v, **kwargs)
            assert str(info.value) == expected


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dims", [4, 3], ids=["4d_takes_flash", "3d_takes_math"])
def test_attention_under_the_overrideable_backend_runs_the_hosts_default_kernel(dims, mode):
    """sdpa_kernel(SDPBackend.OVERRIDEABLE) asks for a PrivateUse1 backend's own fused kernel
    (what TorchNeuron's choice picks); CPU has none, and neuron asked CPU's choice, which found
    "No viable backend". The device's fused kernel is the host's default pick (Note [The
    overrideable SDPA backend]): flash where it applies, math elsewhere, CPU's bits; the
    user's flags are as they set them, before and after."""
    g = torch.Generator().manual_seed(2)
    shape = (1, 2, 5, 4) if dims == 4 else (2, 5, 4)
    q, k, v = (torch.randn(*shape, generator=g, requires_grad=True) for _ in range(3))
    kernel = FLASH_OPS[0] if dims == 4 else MATH_OPS[0]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    qn, kn, vn = _to_neuron((q, k, v))
    only_overrideable = [False, False, True]  # flash, math, overrideable
    with adaptive_eager.mode(mode):
        for _ in range(4):  # adaptive: also replayed in a fused trace
            with torch.nn.attention.sdpa_kernel(SDPBackend.OVERRIDEABLE):
                names = _kernel_ops(lambda: F.scaled_dot_product_attention(qn, kn, vn, is_causal=True))
                out_n = F.scaled_dot_product_attention(qn, kn, vn, is_causal=True)
                assert [torch._C._get_flash_sdp_enabled(), torch._C._get_math_sdp_enabled(),
                        torch._C._get_overrideable_sdp_enabled()] == only_overrideable
            assert kernel in names
            assert torch.equal(out_n.cpu(), out)
            for a, b in zip(grads, torch.autograd.grad(out_n.square().sum(), (qn, kn, vn))):
                assert torch.equal(b.cpu(), a)
        with torch.nn.attention.sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # no overrideable: CPU's choice
            if dims == 3:  # flash does not take 3-D inputs: CPU's refusal
                expected = _cpu_error(lambda: F.scaled_dot_product_attention(q, k, v))
                with pytest.raises(RuntimeError) as info:
                    F.scaled_dot_product_attention(qn, kn, vn)
                assert str(info.value) == expected


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_attention_under_the_overrideable_backend_matches_eager():
    """The same under torch.compile: the traced graph holds the host's default kernel."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 6, 8, generator=g)
    qn = q.to("neuron")

    def f(x):
        with torch.nn.attention.sdpa_kernel(SDPBackend.OVERRIDEABLE):
            return F.scaled_dot_product_attention(x, x, x, is_causal=True)

    expected = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert torch.equal(torch.compile(f, backend="aot_eager")(qn).cpu(), expected)
    assert torch.equal(torch.compile(f)(qn).cpu(), expected)


# -- RMSNorm ----------------------------------------------------------------------------------

RMS_CASES = {
    "weight": {"weight": True, "eps": 1e-5},
    "no_weight": {"weight": False, "eps": 1e-5},
    "default_eps": {"weight": True, "eps": None},
}


@pytest.mark.parametrize("case", list(RMS_CASES))
def test_rms_norm_is_one_op_each_way_and_matches_cpu_and_the_composite(case, eager):
    spec = RMS_CASES[case]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 3, 8, generator=g, requires_grad=True)
    w = torch.randn(8, generator=g, requires_grad=True) if spec["weight"] else None
    xn, wn = _to_neuron((x,))[0], (_to_neuron((w,))[0] if w is not None else None)
    y = F.rms_norm(x, (8,), w, spec["eps"])
    fwd = _kernel_ops(lambda: F.rms_norm(xn, (8,), wn, spec["eps"]))
    assert fwd == ["neuron.rms_norm.default"]
    yn = F.rms_norm(xn, (8,), wn, spec["eps"])
    assert torch.equal(yn.cpu(), y)
    leaves, leaves_n = [t for t in (x, w) if t is not None], [t for t in (xn, wn) if t is not None]
    grads = torch.autograd.grad(y.square().sum(), leaves)
    loss = yn.square().sum()
    bwd = _kernel_ops(lambda: torch.autograd.grad(loss, leaves_n, retain_graph=True))
    assert bwd.count("neuron.rms_norm_backward.default") == 1
    assert "aten.rsqrt.default" not in bwd and "aten.mean.dim" not in bwd
    grads_n = torch.autograd.grad(loss, leaves_n)
    for a, b in zip(grads, grads_n):
        assert torch.equal(b.cpu(), a)
    # The composite decomposition run op by op on neuron gives the same bits.
    xc, wc = xn.detach().requires_grad_(), (wn.detach().requires_grad_() if wn is not None else None)
    composite = torch.ops.aten.rms_norm.default.decompose(xc, [8], wc, spec["eps"])
    assert torch.equal(composite.cpu(), y)
    for a, b in zip(torch.autograd.grad(composite.square().sum(), [t for t in (xc, wc) if t is not None]), grads):
        assert torch.equal(a.cpu(), b)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("weight", [True, False], ids=["weight", "no_weight"])
def test_rms_norm_beside_its_input_gives_the_input_cpus_gradient(mode, dtype, weight):
    """x + rms_norm(x): x's gradient is the residual's plus one per read of x in the norm, added
    one by one as CPU autograd adds them (Note [RMSNorm's input gradient, use by use]); their
    sum handed over at once was 1 ulp off in float32 and float64. bfloat16's norm reads an
    upcast copy, once."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 16, generator=g).to(dtype)
    w = torch.randn(16, generator=g).to(dtype) if weight else None

    def grads(device):
        xd = x.to(device, copy=True).requires_grad_()
        wd = w.to(device, copy=True).requires_grad_() if weight else None
        (xd + F.rms_norm(xd, (16,), wd)).float().square().sum().backward()
        return [t.grad for t in (xd, wd) if t is not None]

    expected = grads("cpu")
    with adaptive_eager.mode(mode):
        adaptive_eager.reset_stats()
        for _ in range(6):  # adaptive: also replayed in a fused trace
            for a, b in zip(expected, grads("neuron")):
                assert torch.equal(b.cpu(), a), f"{(b.cpu() - a).abs().max()} from CPU's"
        if mode == "adaptive":
            assert adaptive_eager.stats().trace_hits > 0, "no replay: the fused trace went unchecked"


def test_rms_norm_gradient_for_the_weight_alone(eager):
    x, w = torch.randn(3, 8), torch.randn(8, requires_grad=True)
    xn, wn = x.to("neuron"), w.detach().to("neuron").requires_grad_()
    F.rms_norm(xn, (8,), wn).sum().backward()
    F.rms_norm(x, (8,), w).sum().backward()
    assert xn.grad is None
    assert torch.equal(wn.grad.cpu(), w.grad)


def test_rms_norm_under_autocast_runs_in_float32(eager):
    x = torch.randn(3, 8)
    norm = nn.RMSNorm(8)
    norm_n = nn.RMSNorm(8).to("neuron")
    with torch.autocast("neuron", torch.bfloat16):
        yn = norm_n(x.bfloat16().to("neuron"))
    assert yn.dtype == torch.float32
    assert torch.equal(yn.cpu(), norm(x.bfloat16().float()))


def test_compiled_attention_and_rms_norm_match_eager_forward_and_backward(eager):
    """torch.compile traces the kernels with their host bodies on FakeTensors (fake=True), and
    the traced attention keeps the kernel the host picks (chosen outside the tracing modes)."""
    def f(q, w):
        return F.rms_norm(F.scaled_dot_product_attention(q, q, q, is_causal=True), (4,), w)

    q, w = _to_neuron((torch.randn(2, 2, 5, 4, requires_grad=True), torch.randn(4, requires_grad=True)))
    q2, w2 = _to_neuron((q, w))
    expected = f(q, w)
    expected.square().sum().backward()
    torch._dynamo.reset()
    try:
        got = torch.compile(f, backend="aot_eager")(q2, w2)
        got.square().sum().backward()
    finally:
        torch._dynamo.reset()
    assert torch.equal(got.cpu(), expected.cpu())
    assert torch.equal(q2.grad.cpu(), q.grad.cpu()) and torch.equal(w2.grad.cpu(), w.grad.cpu())


# -- both kernels in a training loop, eager and adaptive ------------------------------------

class TinyBlock(nn.Module):
    def __init__(self, dim=16, heads=2, dropout=0.0):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv, self.proj, self.head = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), nn.Linear(dim, 4)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return self.head(self.norm2(x))


def _train(device, mode, steps=8, dropout=0.0):
    torch.manual_seed(0)  # seeds the generator neuron draws from too
    model = TinyBlock(dropout=dropout).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(2, 6, 16, generator=g).to(device), torch.randn(2, 6, 4, generator=g).to(device))
            for _ in range(steps)]
    losses, per_step = [], []
    torch.manual_seed(1)  # dropout draws from CPU's generator, on CPU and on neuron
    with adaptive_eager.mode(mode):
        adaptive_eager.reset_stats()
        for x, y in data:
            before = _launches()
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            per_step.append(_launches() - before)
        losses = [float(v) for v in losses]
    return losses, per_step, [p.detach().cpu() for p in model.parameters()]


def test_training_with_both_kernels_matches_cpu_in_eager_and_adaptive_mode():
    cpu_losses, _, cpu_params = _train("cpu", "eager")
    for mode in MODES:
        losses, per_step, params = _train("neuron", mode)
        assert losses == cpu_losses, mode
        for a, b in zip(params, cpu_params):
            assert torch.equal(a, b), mode
    assert per_step[-1] == 1, per_step  # adaptive: a whole step, both kernels included, is one launch
    with record_ops(devices=["neuron"], source=False) as rec:
        _train("neuron", "eager", steps=1)
    kernels = [n for n in rec.names() if n.startswith("neuron.") or "attention" in n]
    assert sorted(kernels) == sorted(list(FLASH_OPS)
                                     + ["neuron.rms_norm.default", "neuron.rms_norm_backward.default"] * 2)


def test_training_with_attention_dropout_matches_cpu_in_eager_and_adaptive_mode():
    cpu_losses, _, cpu_params = _train("cpu", "eager", dropout=0.3)
    assert cpu_losses != _train("cpu", "eager")[0], "dropout changed nothing: the test compares nothing random"
    for mode in MODES:
        losses, per_step, params = _train("neuron", mode, dropout=0.3)
        assert losses == cpu_losses, mode
        for a, b in zip(params, cpu_params):
            assert torch.equal(a, b), mode
    assert per_step[-1] == 1, per_step  # the dropout kernel joins the step's fused launch
