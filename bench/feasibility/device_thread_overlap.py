"""Feasibility measurement (not a benchmark of the product): can a fused launch's replay run
beside the host while it issues the next step?

Issue 3 asks for adaptive wall time <= 0.7x eager on the MLP step. About 40% of an
adaptive step is the replay's host kernels, so the replay has to overlap the issuing of the
next step, as a device would. This script compares, with OMP_NUM_THREADS=1:
- a Python thread running a replay (the GIL hand-offs between small ops),
- a C++ thread that never takes the GIL (torch.utils.cpp_extension.load_inline; needs g++
  and ninja, about 30 s to compile once).

    OMP_NUM_THREADS=1 python bench/feasibility/device_thread_overlap.py

Without OMP_NUM_THREADS=1 every new thread starts its own OpenMP pool, whose spinning
threads make every overlap variant several times slower than running one after the other.

What came of it: the C++ thread is the device stream (device/_stream.cpp), which runs
every complete fused launch; its worker takes the issuing thread's intra-op thread count,
so the OpenMP trap above does not apply to it.
"""
import threading
import time

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

import adaptive_eager  # noqa: F401  (registers neuron)
from adaptive_eager import pending

_CPP = r'''
#include <torch/extension.h>
#include <memory>
#include <thread>
struct Job { std::thread t; };
// A stand-in for a fused launch: an MLP's forward and backward matmuls on host tensors.
void replay(std::vector<at::Tensor> w, at::Tensor x) {
  auto h = x;
  for (auto& wi : w) { h = at::relu(at::mm(h, wi)); }
  auto g = at::ones_like(h);
  for (int i = (int)w.size() - 1; i >= 0; --i) { g = at::mm(g, w[i].t()); g = at::threshold_backward(g, g, 0); }
}
std::shared_ptr<Job> start(std::vector<at::Tensor> w, at::Tensor x) {
  auto j = std::make_shared<Job>();
  j->t = std::thread(replay, w, x);
  return j;
}
void join(std::shared_ptr<Job> j) { py::gil_scoped_release no_gil; j->t.join(); }
void run_here(std::vector<at::Tensor> w, at::Tensor x) { py::gil_scoped_release no_gil; replay(w, x); }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Job, std::shared_ptr<Job>>(m, "Job");
  m.def("start", &start); m.def("join", &join); m.def("run_here", &run_here);
}
'''


def best_us(fn, n=30, rounds=7) -> float:
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e6


def main() -> None:
    torch.set_num_threads(1)
    ext = load_inline("neuron_overlap_feasibility", cpp_sources=_CPP, extra_cflags=["-O2"])
    weights, x_host = [torch.randn(256, 256) for _ in range(3)], torch.randn(64, 256)

    def replay_python():
        h = x_host
        for w in weights:
            h = torch.relu(h @ w)
        g = torch.ones_like(h)
        for w in reversed(weights):
            g = torch.ops.aten.threshold_backward(g @ w.t(), g @ w.t(), 0)

    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10)).to("neuron")
    opt = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(64, 256).to("neuron"), torch.randint(0, 10, (64,)).to("neuron")

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(40):
        step()
    torch.neuron.synchronize()
    full = best_us(step)
    launch = pending.Pending.launch
    # The issue phase alone: the engine matches and defers; the launch is skipped.
    pending.Pending.launch = lambda self: (setattr(self, "done", self.pos), self.pos)[1]
    try:
        issue = best_us(step)
        cpp = best_us(lambda: ext.run_here(weights, x_host))
        python = best_us(replay_python)

        def with_cpp_thread():
            job = ext.start(weights, x_host)
            step()
            ext.join(job)

        def with_python_thread():
            t = threading.Thread(target=replay_python)
            t.start()
            step()
            t.join()

        both_cpp, both_python = best_us(with_cpp_thread), best_us(with_python_thread)
    finally:
        pending.Pending.launch = launch
    print(f"adaptive MLP step {full:.0f} us; its issue phase alone {issue:.0f} us")
    print(f"replay stand-in: C++ {cpp:.0f} us, Python {python:.0f} us")
    print(f"issue phase with the replay on a C++ thread:    {both_cpp:.0f} us (one after the other: {issue + cpp:.0f})")
    print(f"issue phase with the replay on a Python thread: {both_python:.0f} us (one after the other: {issue + python:.0f})")


if __name__ == "__main__":
    main()
