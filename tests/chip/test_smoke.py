import torch

import adaptive_eager


def test_to_neuron_and_matmul_match_cpu():
    x = torch.randn(4, 4)
    y = x.to("neuron")
    assert y.device == torch.device("neuron:0")
    assert torch.equal((y @ y).cpu(), x @ x)


def test_each_op_is_one_launch_and_copies_are_transfers():
    x = torch.randn(8).to("neuron")
    (x + 1).mul_(2)
    s = adaptive_eager.stats()
    assert (s.launches, s.transfers) == (2, 1)
