"""Train a small MLP on the emulated device and on CPU; show that they agree, and what the
device spent. (The eager-vs-adaptive comparison arrives with the adaptive engine.)"""
import time

import torch

import adaptive_eager


def train(device: str, steps: int = 20):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 10)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1)
    losses = []
    start = time.perf_counter()
    for _ in range(steps):
        x = torch.randn(32, 64, generator=data).to(device)
        y = torch.randint(0, 10, (32,), generator=data).to(device)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, (time.perf_counter() - start) / steps


if __name__ == "__main__":
    steps = 20
    cpu_losses, cpu_s = train("cpu", steps)
    adaptive_eager.reset_stats()
    neuron_losses, neuron_s = train("neuron", steps)
    s = adaptive_eager.stats()
    print(f"{'':24}{'cpu':>12}{'neuron':>12}")
    print(f"{'final loss':24}{cpu_losses[-1]:>12.6f}{neuron_losses[-1]:>12.6f}")
    print(f"{'losses bit-identical':24}{'':>12}{str(cpu_losses == neuron_losses):>12}")
    print(f"{'wall ms / step':24}{cpu_s * 1e3:>12.2f}{neuron_s * 1e3:>12.2f}")
    print(f"{'ops / step':24}{'':>12}{s.ops / steps:>12.1f}")
    print(f"{'launches / step':24}{'':>12}{s.launches / steps:>12.1f}")
    print(f"{'device us / step':24}{'':>12}{s.device_time_us / steps:>12.1f}")
    print(f"{'peak device memory':24}{'':>12}{s.peak_memory_bytes:>12d}")
