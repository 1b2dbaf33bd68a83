"""Neuron tensors are real PrivateUse1 tensors with storage from
the C++ allocator, every op run by the C++ eager path (device/csrc/aten/run_on_host.cpp).

Each test pins a symptom of the wrapper design (issue 11's table) or a behaviour the
eager path must keep: CPU's bits, one launch per op, exact memory accounting.
"""
from __future__ import annotations

import io

import pytest
import torch

import adaptive_eager
from adaptive_eager.dispatch.context import CONTEXT
from subproc import run_json

NEURON = torch.device("neuron")
NEURON_0 = torch.device("neuron:0")



# -- a neuron tensor is a tensor --------------------------------------------------------------
def test_a_neuron_tensor_is_a_plain_tensor_with_its_own_storage():
    x = torch.arange(6.0, device=NEURON)
    assert type(x) is torch.Tensor
    assert x.device == torch.device("neuron:0") and x.is_neuron
    storage = x.untyped_storage()  # raised on the wrapper
    assert storage.device == x.device and storage.nbytes() == 24
    assert x.data_ptr() != 0 and x.data_ptr() == storage.data_ptr()  # was 0 for every wrapper


def test_views_share_their_bases_bytes_as_on_any_device():
    x = torch.zeros(4, 4, device=NEURON)
    row, col = x[1], x[:, 2]
    assert row.data_ptr() == x.data_ptr() + 4 * 4
    assert col.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    row.fill_(1.0)
    col.add_(2.0)
    expected = torch.zeros(4, 4)
    expected[1] = 1.0
    expected[:, 2] += 2.0
    assert torch.equal(x.cpu(), expected)


def test_views_whose_aten_kernels_are_per_device_are_views_on_neuron_with_no_launch():
    # unfold (which `repeat` uses), view_as_real, view_as_complex: ATen registers them per
    # device, not as composites; on neuron they are metadata-only views, as on CPU.
    x = torch.arange(12.0, device=NEURON)
    z = torch.randn(3, 2, device=NEURON)
    before = adaptive_eager.stats().launches
    with adaptive_eager.mode("eager"):
        windows, complex_ = x.unfold(0, 4, 2), torch.view_as_complex(z)
        real = torch.view_as_real(complex_)
    assert adaptive_eager.stats().launches == before
    for view, base in ((windows, x), (complex_, z), (real, z)):
        assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    assert torch.equal(windows.cpu(), torch.arange(12.0).unfold(0, 4, 2))
    assert torch.equal(complex_.cpu(), torch.view_as_complex(z.cpu())) and torch.equal(real.cpu(), z.cpu())
    windows[1].fill_(-1.0)  # writes through to the base, as a view's do
    assert x.cpu()[2:6].eq(-1.0).all()


def test_assigning_dot_data_replaces_the_parameters_value():
    # The wrapper silently ignored it: C++ set_data never reached __torch_dispatch__.
    p = torch.nn.Parameter(torch.zeros(3, device=NEURON))
    p.data = torch.ones(3, device=NEURON)
    assert torch.equal(p.cpu(), torch.ones(3))
    assert (p * 2).sum().item() == 6.0


def test_assigning_a_neuron_value_to_a_cpu_parameters_data_moves_it():  # as FSDP2 moves modules
    p = torch.nn.Parameter(torch.arange(3.0))
    p.data = p.data.to(NEURON)  # torch refused: PrivateUse1 was not among its dense backends
    assert p.device == torch.device("neuron:0") and isinstance(p, torch.nn.Parameter)
    assert torch.equal((p * 2).cpu(), torch.arange(3.0) * 2)


def test_torch_save_keeps_views_sharing_their_storage():
    base = torch.arange(8.0, device=NEURON)
    buf = io.BytesIO()
    torch.save({"base": base, "view": base[2:5]}, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert loaded["base"].device == NEURON.__class__("neuron:0")
    loaded["view"].fill_(-1.0)  # one storage after loading, as before saving
    assert torch.equal(loaded["base"].cpu(), torch.tensor([0, 1, -1, -1, -1, 5, 6, 7.0]))
    buf.seek(0)
    on_host = torch.load(buf, map_location="cpu")
    assert on_host["base"].device.type == "cpu" and torch.equal(on_host["view"], torch.tensor([2, 3, 4.0]))


def test_torch_save_of_a_value_the_device_has_not_made_yet_saves_its_value():
    # torch.save's persistent_id reads the storage's data_ptr(), which torch's binding refused
    # ('invalid python storage') while a queued op's output had no bytes (Note [A deferred
    # output's bytes exist at issue]).
    from adaptive_eager.device import native

    with adaptive_eager.mode("eager"):
        torch.arange(8.0, device=NEURON).mul(2)  # their first calls wait and learn their plans: the next ones are posted
        torch.neuron.synchronize()
        native.sleep_on_device(0.2)
        value = torch.arange(8.0, device=NEURON).mul(2)
        assert not native.has_bytes(value)
        buf = io.BytesIO()
        torch.save(value, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf, map_location="cpu"), torch.arange(8.0) * 2)


def test_safetensors_saves_a_neuron_state_dict_that_loads_back_onto_neuron(tmp_path):
    # On the wrapper, save_file raised "access the data pointer on an invalid python storage".
    safetensors_torch = pytest.importorskip("safetensors.torch")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).to(NEURON)
    path = str(tmp_path / "model.safetensors")
    safetensors_torch.save_file(model.state_dict(), path)
    # load_file(device='neuron') is refused by safetensors itself (its list of device names):
    # load on the host, then into the neuron model.
    restored = torch.nn.Linear(3, 2).to(NEURON)
    restored.load_state_dict(safetensors_torch.load_file(path))
    assert restored.weight.device == torch.device("neuron:0")
    for a, b in zip(restored.parameters(), model.parameters()):
        assert torch.equal(a.cpu(), b.cpu())
    with pytest.raises(RuntimeError, match="share memory"):  # tied tensors found, as on CPU
        safetensors_torch.save_file({"a": model.weight, "b": model.weight}, path)


def test_an_untyped_storage_resizes_in_place_as_fsdp_needs():
    # FSDP1 frees and regrows parameter storage with untyped_storage().resize_().
    x = torch.ones(16, device=NEURON)
    before = torch.neuron.memory_allocated()
    x.untyped_storage().resize_(0)
    assert torch.neuron.memory_allocated() == before - 64
    # still the device's storage (it moved to the CPU at size 0, so FSDP1's set_ of a shard failed)
    assert x.untyped_storage().device == NEURON_0 and x.device == NEURON_0
    x.untyped_storage().resize_(64)
    assert torch.neuron.memory_allocated() == before
    x.fill_(3.0)
    assert torch.equal(x.cpu(), torch.full((16,), 3.0))


# -- memory -----------------------------------------------------------------------------------
def test_every_result_is_charged_to_its_device_until_it_dies():
    before = torch.neuron.memory_allocated()
    a = torch.ones(1000, device=NEURON)
    b = a * 2  # a new result of the eager path: charged as it arrives
    assert torch.neuron.memory_allocated() == before + 8000
    assert torch.accelerator.memory_allocated() == before + 8000
    del a
    assert torch.neuron.memory_allocated() == before + 4000
    del b
    assert torch.neuron.memory_allocated() == before


def test_memory_is_charged_on_the_tensors_own_device():
    before0, before1 = torch.neuron.memory_allocated(0), torch.neuron.memory_allocated(1)
    x = torch.ones(100, device="neuron:1")
    y = x + 1
    assert y.device == torch.device("neuron:1")
    assert torch.neuron.memory_allocated(0) == before0
    assert torch.neuron.memory_allocated(1) == before1 + 800


def test_an_allocation_beyond_capacity_is_an_out_of_memory_error_that_names_the_fix():
    capacity = torch.neuron.get_device_properties().total_memory
    with pytest.raises(torch.OutOfMemoryError, match="neuron:0 out of memory.*NEURON_DEVICE_MEMORY"):
        torch.empty(capacity // 4 + 1, device=NEURON)  # charged before any host memory is taken
    assert torch.ones(2, device=NEURON).sum().item() == 2.0  # the device is usable after


# -- the clock --------------------------------------------------------------------------------
def test_each_op_is_one_launch_and_each_host_copy_one_transfer():
    x = torch.randn(8, 8).to(NEURON)
    adaptive_eager.reset_stats()
    y = (x @ x).relu()
    s = adaptive_eager.stats()
    assert (s.ops, s.launches, s.kernel_ops, s.transfers) == (2, 2, 2, 0)
    y.cpu()
    s = adaptive_eager.stats()
    assert (s.launches, s.transfers, s.transfer_bytes) == (2, 1, 256)
    assert s.device_time_us > 2 * CONTEXT.runtime.cost.launch_overhead_us


def test_adaptive_mode_is_the_default():
    assert adaptive_eager.get_mode() == "adaptive"


# -- CPU's bits ---------------------------------------------------------------------------------
def _train(model_fn, batches, device, steps=4, opt_fn=None, amp=False):
    torch.manual_seed(0)
    model = model_fn().to(device)
    opt = (opt_fn or (lambda ps: torch.optim.AdamW(ps, lr=1e-2)))(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    losses = []
    for step in range(steps):
        x, y = (t.to(device) for t in batches[step % len(batches)])
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.detach().cpu())
    return losses, [p.detach().cpu() for p in model.parameters()], [b.cpu() for b in model.buffers()]


def _assert_same_bits(a, b):
    for x, y in zip(a, b):
        for u, v in zip(x, y):
            assert torch.equal(u, v)


def test_mlp_trains_to_cpus_bits():
    torch.manual_seed(1)
    batches = [(torch.randn(16, 12), torch.randint(0, 4, (16,))) for _ in range(2)]

    def mlp():
        return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))

    _assert_same_bits(_train(mlp, batches, "cpu"), _train(mlp, batches, NEURON))


def test_cnn_with_batch_norm_trains_to_cpus_bits():
    torch.manual_seed(2)
    batches = [(torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))) for _ in range(2)]

    def cnn():
        return torch.nn.Sequential(torch.nn.Conv2d(3, 6, 3, padding=1), torch.nn.BatchNorm2d(6), torch.nn.SiLU(),
                                   torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(6 * 16, 5))

    _assert_same_bits(_train(cnn, batches, "cpu"), _train(cnn, batches, NEURON))


def test_transformer_layer_trains_to_cpus_bits():
    torch.manual_seed(3)
    batches = [(torch.randn(2, 5, 16), torch.randint(0, 16, (2, 5))) for _ in range(2)]

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)

        def forward(self, x):
            return self.layer(x).transpose(1, 2)  # (batch, classes=16, positions)

    _assert_same_bits(_train(Model, batches, "cpu"), _train(Model, batches, NEURON))


def test_random_ops_draw_cpus_numbers_from_cpus_generator():
    def draws(device):
        torch.manual_seed(7)
        x = torch.ones(32, device=device)
        return [torch.randn(5, device=device), torch.rand(3, device=device).bernoulli(),
                torch.empty(4, device=device).normal_(), torch.randperm(6, device=device),
                *torch.native_dropout(x, 0.5, True)]  # called by name: CPU's kernel on neuron too

    for a, b in zip(draws("cpu"), draws(NEURON)):
        assert torch.equal(a, b.cpu())
    torch.manual_seed(7)
    torch.randn(100)  # CPU draws in between move the generator neuron draws from too
    torch.randn(5, device=NEURON)
    after = torch.randn(5)
    torch.manual_seed(7)
    torch.randn(100)
    torch.randn(5)
    assert torch.equal(torch.randn(5), after)


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
def test_dropout_gives_cpus_bits_for_every_p_forward_and_backward_and_draws_in_cpus_order(mode):
    """Note [Dropout takes CPU's path]: torch sends F.dropout on any accelerator to native_dropout,
    which scales by a rounded 1 / (1 - p) where CPU divides its noise by 1 - p; 15 of these 99
    values of p (0.04, 0.09, 0.15, ...) gave other last bits, forward and backward."""
    adaptive_eager.set_mode(mode)

    def run(device, p):
        torch.manual_seed(5)
        x = (torch.arange(256.0) / 7).to(device).requires_grad_()
        y = torch.nn.functional.dropout(x, p)
        (y * torch.arange(256.0, device=device)).sum().backward()
        return y.detach().cpu(), x.grad.cpu(), torch.rand(4, device=device).cpu()  # the stream after

    differ = [p for p in (i / 100 for i in range(1, 100))
              if not all(torch.equal(a, b) for a, b in zip(run("cpu", p), run(NEURON, p)))]
    assert differ == []


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
def test_dropout_of_a_transposed_input_under_inference_mode_gives_cpus_bits(mode):
    # inference_mode reaches the PrivateUse1 key, below autograd's: the same path there.
    adaptive_eager.set_mode(mode)

    def run(device):
        torch.manual_seed(5)
        x = (torch.arange(96.0) / 7).to(device).view(8, 12).t()
        with torch.inference_mode():
            return torch.nn.functional.dropout(x, 0.04).cpu(), torch.nn.Dropout(0.09)(x).cpu()

    for a, b in zip(run("cpu"), run(NEURON)):
        assert torch.equal(a, b) and a.stride() == b.stride()


def test_a_neuron_generator_drives_the_eager_path_as_a_cpu_one_drives_cpu():
    g, cpu = torch.Generator(device="neuron").manual_seed(11), torch.Generator().manual_seed(11)
    assert torch.equal(torch.randperm(9, device=NEURON, generator=g).cpu(), torch.randperm(9, generator=cpu))
    p = torch.full((16,), 0.5)
    assert torch.equal(p.to(NEURON).bernoulli(generator=g).cpu(), p.bernoulli(generator=cpu))


def test_ops_on_two_devices_are_refused_with_the_fix():
    with pytest.raises(RuntimeError, match="same device.*neuron:0 and neuron:1"):
        torch.ones(2, device="neuron:0") + torch.ones(2, device="neuron:1")
    with pytest.raises(RuntimeError, match="same device.*neuron:0 and cpu"):
        torch.ones(2, device=NEURON) + torch.ones(2)
    assert (torch.ones(2, device=NEURON) + torch.tensor(1.0)).device == torch.device("neuron:0")  # a CPU scalar


@pytest.mark.parametrize("write", [
    lambda x: x[1:].copy_(x[:-1]),
    lambda x: torch.add(x[:-1], 1, out=x[1:]),
    lambda x: x.index_copy_(0, torch.tensor([0, 1], device=x.device), x[2:4]),
], ids=["copy_", "add-out", "index_copy_"])
def test_a_write_overlapping_its_input_is_refused_as_on_cpu(write):
    # Each argument had a host alias of its own, so CPU kernels saw no overlap: x[1:].copy_(x[:-1])
    # silently wrote zeros. Arguments on one storage now share one alias storage.
    for device in ("cpu", NEURON):
        x = torch.arange(6.0, device=device)
        with pytest.raises(RuntimeError, match="refer to a single memory location"):
            write(x)


def test_inputs_sharing_a_storage_give_cpus_values():
    expected = torch.arange(6.0)
    expected[:3] *= expected[3:].clone()
    x = torch.arange(6.0, device=NEURON)
    x[:3].mul_(x[3:])
    assert torch.equal(x.cpu(), expected)
    y = torch.arange(4.0, device=NEURON)
    assert torch.equal(y.add_(y).cpu(), torch.arange(4.0) * 2)


def test_an_out_argument_of_the_wrong_size_is_resized_as_on_cpu():
    out = torch.empty(0, device=NEURON)
    torch.mul(torch.arange(6.0, device=NEURON).view(2, 3), 2, out=out)
    assert out.shape == (2, 3) and torch.equal(out.cpu(), torch.arange(6.0).view(2, 3) * 2)


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
def test_an_out_argument_that_is_its_input_too_is_resized_with_it_as_on_cpu(mode):
    # Note [One tensor, one alias]: on CPU, torch.sum(a, 0, out=a) resizes a, its input too,
    # before reducing (torch warns): zeros. Neuron gave each argument a host tensor of its own,
    # and the real sum.
    adaptive_eager.set_mode(mode)
    seen = []
    for device in ("cpu", NEURON):
        a = torch.arange(12.0, device=device).reshape(3, 4)
        with pytest.warns(UserWarning, match="was resized"):
            result = torch.sum(a, 0, out=a)
        assert result is a
        whole = torch.tensor([], device=device).set_(a.untyped_storage()).cpu()  # the bytes past a too
        seen.append((a.shape, a.stride(), a.cpu().tolist(), whole.tolist()))
    assert seen[1] == seen[0]


def test_map_location_neuron_loads_a_cpu_checkpoint_onto_the_device():
    """Once a footgun (the wrapper kept such tensors on the host): a real storage moves to
    the device, as with 'cuda'."""
    buf = io.BytesIO()
    torch.save({"w": torch.arange(3.0)}, buf)
    buf.seek(0)
    w = torch.load(buf, map_location="neuron", weights_only=True)["w"]
    assert w.device == torch.device("neuron:0") and w.tolist() == [0.0, 1.0, 2.0]


def test_backward_keeps_cpus_bits_after_another_thread_sets_the_thread_count():
    # Note [Kernels take the host's thread count]: DataLoader's pin-memory thread calls
    # torch.set_num_threads(1); autograd's thread for neuron took that count, not the user's
    # thread's, and a convolution's backward reduced in another order than CPU's. A fresh
    # process: the count is process state, and the check needs the user's thread at 2 or more.
    out = run_json("""
        import threading, torch
        torch.set_num_threads(2)
        side = threading.Thread(target=torch.set_num_threads, args=(1,))
        side.start(); side.join()

        def train(device):
            torch.manual_seed(2)
            model = torch.nn.Sequential(torch.nn.Conv2d(3, 6, 3, padding=1), torch.nn.BatchNorm2d(6),
                                        torch.nn.SiLU(), torch.nn.Flatten(), torch.nn.Linear(6 * 64, 5)).to(device)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))
            losses = []
            for _ in range(3):
                loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            return losses, [p.detach().cpu() for p in model.parameters()]

        cpu, neuron = train("cpu"), train("neuron")
        emit({"threads": torch.get_num_threads(), "losses": cpu[0] == neuron[0],
              "params": all(torch.equal(a, b) for a, b in zip(cpu[1], neuron[1]))})
    """)
    assert out == {"threads": 2, "losses": True, "params": True}
