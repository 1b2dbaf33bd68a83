"""torch.autocast('neuron') follows CUDA's policy lists; GradScaler('neuron') trains like CPU's."""
import pytest
import torch
import torch.nn.functional as F

from adaptive_eager.dispatch import autocast as neuron_autocast

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _pair(*shape, dtype=FP32):
    cpu = torch.randn(*shape, dtype=dtype)
    return cpu, cpu.to("neuron")


def _same_under_autocast(fn, cpu_args, dtype=BF16):
    """fn on neuron under autocast('neuron') vs fn on CPU under autocast('cpu'): same bits."""
    with torch.autocast("cpu", dtype=dtype):
        expected = fn(*cpu_args)
    with torch.autocast("neuron", dtype=dtype):
        got = fn(*(a.to("neuron") if isinstance(a, torch.Tensor) else a for a in cpu_args))
    assert got.device.type == "neuron"
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=0)
    return got


def test_registered_op_set_is_exactly_torchs_autocast_cuda_set():
    # The policy table is hand-written from autocast_mode.h; this pins it to the installed torch.
    registered = set(neuron_autocast.policy_table())
    expected = neuron_autocast.cuda_autocast_ops() - set(neuron_autocast.NOT_REGISTERED)
    assert registered == expected


def test_every_policy_op_has_a_kernel_on_autocast_privateuse1():
    missing = [name for name in neuron_autocast.policy_table()
               if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "AutocastPrivateUse1")]
    assert missing == []


@pytest.mark.parametrize("fn", [
    lambda a, b: torch.mm(a, b),
    lambda a, b: a @ b,
    lambda a, b: F.linear(a, b),
    lambda a, b: torch.addmm(a, a, b),
    lambda a, b: torch.bmm(a[None], b[None]),
    lambda a, b: torch.baddbmm(a[None], a[None], b[None]),
], ids=["mm", "matmul", "linear", "addmm", "bmm", "baddbmm"])
def test_lower_precision_ops_match_cpu_autocast_bits(fn):
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    assert _same_under_autocast(fn, (a, b)).dtype == BF16


def test_conv2d_runs_in_bf16_like_cpu_autocast():
    x, w = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)
    assert _same_under_autocast(F.conv2d, (x, w)).dtype == BF16


def test_fp32_losses_match_cpu_autocast_bits():
    # mse_loss and nll_loss are fp32 on both CUDA's and CPU's lists.
    a, b = torch.randn(6, 5), torch.randn(6, 5)
    target = torch.randint(0, 5, (6,))
    assert _same_under_autocast(lambda x, y: F.mse_loss(x.bfloat16(), y), (a, b)).dtype == FP32
    assert _same_under_autocast(lambda x, t: F.nll_loss(x.bfloat16(), t), (a, target)).dtype == FP32


def test_output_dtype_per_policy_category():
    _, a = _pair(4, 4)
    half = a.to(BF16)
    with torch.autocast("neuron", dtype=BF16):
        assert torch.mm(a, a).dtype == BF16                          # lower_precision_fp
        assert torch.softmax(half, 1).dtype == FP32                   # fp32_set_opt_dtype
        assert torch.sum(half).dtype == FP32                          # fp32_set_opt_dtype
        assert torch.exp(half).dtype == FP32                          # fp32
        assert F.layer_norm(half, (4,)).dtype == FP32                 # fp32, before decomposition
        assert torch.norm(half, dim=1).dtype == FP32                  # fp32_append_dtype
        assert torch.addcmul(a, half, half).dtype == FP32             # promote: widest is fp32
        assert torch.addcmul(half, half, half).dtype == BF16          # promote: all bf16 stay
        assert torch.cat([half, a]).dtype == FP32                     # not listed: cat promotes itself
        assert torch.relu(half).dtype == BF16                         # not listed: untouched


def test_softmax_under_autocast_equals_manual_fp32_reference():
    # CUDA's list makes softmax fp32, CPU's list does not cover it: compare with a manual cast.
    cpu, dev = _pair(5, 7)
    half_cpu = cpu.to(BF16)
    with torch.autocast("neuron", dtype=BF16):
        got = torch.softmax(dev.to(BF16), dim=1)
        got_log = F.log_softmax(dev.to(BF16), dim=1)
    torch.testing.assert_close(got.cpu(), torch.softmax(half_cpu.float(), dim=1), rtol=0, atol=0)
    torch.testing.assert_close(got_log.cpu(), F.log_softmax(half_cpu.float(), dim=1), rtol=0, atol=0)


def test_explicit_dtype_argument_is_kept_by_fp32_set_opt_dtype():
    _, a = _pair(4, 4)
    with torch.autocast("neuron", dtype=BF16):
        assert torch.sum(a.to(BF16), dtype=BF16).dtype == BF16
        assert torch.softmax(a, 1, dtype=torch.float64).dtype == torch.float64


def test_float64_inputs_are_not_cast():
    _, a = _pair(4, 4, dtype=torch.float64)
    with torch.autocast("neuron", dtype=BF16):
        assert torch.mm(a, a).dtype == torch.float64


def test_keyword_arguments_reach_the_op():
    c, a, b = torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4)
    got = _same_under_autocast(lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0), (c, a, b))
    assert got.dtype == BF16
    # And beta really applied: it differs from the beta=1 result.
    with torch.autocast("cpu", dtype=BF16):
        plain = torch.addmm(c, a, b, alpha=2.0)
    assert not torch.equal(got.cpu(), plain)


def test_nested_disabled_region_runs_at_full_precision():
    cpu, dev = _pair(4, 4)
    with torch.autocast("neuron", dtype=BF16):
        assert torch.is_autocast_enabled("neuron")
        with torch.autocast("neuron", enabled=False):
            assert not torch.is_autocast_enabled("neuron")
            out = torch.mm(dev, dev)
        assert torch.mm(dev, dev).dtype == BF16
    assert out.dtype == FP32
    torch.testing.assert_close(out.cpu(), torch.mm(cpu, cpu), rtol=0, atol=0)
    assert torch.mm(dev, dev).dtype == FP32  # and off again after the region


def test_autocast_dtype_is_read_per_region():
    _, a = _pair(4, 4)
    with torch.autocast("neuron", dtype=FP16):
        assert torch.get_autocast_dtype("neuron") == FP16
        assert torch.mm(a, a).dtype == FP16
        with torch.autocast("neuron", dtype=BF16):
            assert torch.mm(a, a).dtype == BF16


def test_fp16_matches_cpu_autocast_bits():
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    assert _same_under_autocast(lambda x, y: F.linear(x, y), (a, b), dtype=FP16).dtype == FP16


def test_backward_through_autocast_matches_cpu():
    w_cpu = torch.randn(6, 8, requires_grad=True)
    w_dev = w_cpu.detach().to("neuron").requires_grad_()
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=BF16):
        F.mse_loss(F.linear(x, w_cpu), torch.zeros(4, 6)).backward()
    with torch.autocast("neuron", dtype=BF16):
        F.mse_loss(F.linear(x.to("neuron"), w_dev), torch.zeros(4, 6, device="neuron")).backward()
    assert w_dev.grad.dtype == FP32 and w_dev.grad.device.type == "neuron"
    torch.testing.assert_close(w_dev.grad.cpu(), w_cpu.grad, rtol=0, atol=0)


def test_binary_cross_entropy_is_banned_like_cuda():
    _, p = _pair(4)
    with torch.autocast("neuron", dtype=BF16):
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(torch.sigmoid(p), torch.ones(4, device="neuron"))


# ---- GradScaler ----

def _mlp_run(device, steps=5, inject_inf_at=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    model, x, y = model.to(device), x.to(device), y.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 10)
    losses, scales = [], []
    for step in range(steps):
        opt.zero_grad()
        with torch.autocast(device, dtype=FP16):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        if step == inject_inf_at:
            with torch.no_grad():
                model[0].weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        losses.append(loss.detach().cpu())
        scales.append(scaler.get_scale())
    return torch.stack(losses), [p.detach().cpu() for p in model.parameters()], scales


def test_gradscaler_training_loop_is_bit_identical_to_cpu():
    # CPU supports fp16 autocast, and for this model (linear, relu, mse_loss) CPU's and CUDA's
    # lists agree (linear lower precision, mse_loss fp32), so bit equality is expected.
    cpu_losses, cpu_params, cpu_scales = _mlp_run("cpu")
    losses, params, scales = _mlp_run("neuron")
    assert losses.dtype == FP32
    torch.testing.assert_close(losses, cpu_losses, rtol=0, atol=0)
    for p, q in zip(params, cpu_params):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert scales == cpu_scales
    assert not torch.equal(losses[0], losses[-1])  # it trained


def test_gradscaler_skips_the_step_and_backs_off_on_inf_grad():
    _, params_before, _ = _mlp_run("neuron", steps=1)
    _, params_after, scales = _mlp_run("neuron", steps=2, inject_inf_at=1)
    _, params_two_steps, _ = _mlp_run("neuron", steps=2)
    # Step 1 saw an inf: the optimizer step is skipped and the scale halves (backoff_factor 0.5).
    for before, after in zip(params_before, params_after):
        torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert scales == [2.0 ** 10, 2.0 ** 9]
    # Without the inf the second step does move the parameters (so the check above can fail).
    assert any(not torch.equal(a, b) for a, b in zip(params_two_steps, params_before))
