// Note [Kernels take the host's thread count]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Some CPU kernels' bits depend on their intra-op thread count: a reduction splits its input
// by thread (convolution and batch norm backward, a long sum). CPU runs a program's kernels
// on the user's thread, with that thread's count. The emulated device runs them on a thread of
// its own, whatever thread issued them (the user's, or autograd's thread for the device, which
// issues every backward op). A new thread takes ATen's global count, which is the last count
// any thread set, not the user's: DataLoader's pin-memory thread calls
// torch.set_num_threads(1), after which a neuron backward ran on 1 thread while CPU's ran on
// 2, and training no longer gave CPU's bits. So each op issued on a user's thread records
// that thread's count, and the device's executor (runtime/executor.cpp), which runs every
// kernel, takes the recorded count before each job.
// Set only when it differs: at::set_num_threads also turns MKL's dynamic threads off for the
// whole process (Note [The stream's intra-op threads] in engine/queue.cpp).
#include "neuron.h"

#include <ATen/Parallel.h>
#include <torch/csrc/autograd/graph_task.h>

#include <atomic>

namespace neuron {
namespace {

std::atomic<int> g_host_threads{0};  // the count of the user's thread that last issued an op
thread_local bool t_device_thread = false;

}  // namespace

void mark_device_thread() { t_device_thread = true; }

int host_thread_count() {
  const int n = g_host_threads.load(std::memory_order_relaxed);
  return n > 0 ? n : at::get_num_threads();
}

void take_host_thread_count() {
  if (t_device_thread) {
    return;  // the stream's worker takes the count its launch was issued with
  }
  // Autograd's threads run a graph task; a user's thread runs none (a CPU backward, which
  // runs on the user's thread, issues no neuron op).
  if (torch::autograd::get_current_graph_task_id() < 0) {
    const int n = at::get_num_threads();
    if (g_host_threads.load(std::memory_order_relaxed) != n) {
      g_host_threads.store(n, std::memory_order_relaxed);
    }
    return;
  }
  // Autograd's thread issues, and the executor runs what it issues with the recorded count.
}

}  // namespace neuron
