// Note [MKL's vector math starts racily]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// ATen's CPU kernels for sqrt, exp, log, tanh, erf and the like call MKL's vector math (VML)
// on each thread's chunk of the tensor. MKL sets VML up at its first call in the process,
// and when that first call comes from two OpenMP threads at once, one of them now and then
// runs its chunk on another code path: on this machine's torch 2.13 (MKL 2024.2), a fresh
// process's first 2-thread torch.sqrt of 8,192 floats gave different bits on the second
// thread's half in about 1 process of 10 (1 of 5 under load), every later call the same as
// each other. CPU shows it too: the same AdamW training on CPU, in 30 fresh processes under
// load, ended with other parameters in 6 (AdamW's first _foreach_sqrt, 32,755 of 32,768
// elements of one thread's chunk). On the device it made `adaptive-eager demo` now and then
// find eager and adaptive mode not bit-identical: eager mode ran the process's first sqrt.
// One call of a VML kernel on one thread, before any kernel runs, sets VML up with no race:
// afterwards 0 of 120 processes differed. Done at install, on the importing thread; it
// steadies the user's own CPU kernels in the process too. The tensors are too small for
// ATen to split among threads (grain 2,048), so no thread team starts here.
#include "neuron.h"

#include <ATen/ATen.h>

namespace neuron {

void set_up_host_vector_math() {
  for (const auto dtype : {at::kFloat, at::kDouble}) {
    // exp goes through VML for float and double (ATen/cpu/vml.h); so would sqrt or tanh
    at::exp(at::ones({8}, at::TensorOptions().dtype(dtype)));
  }
}

}  // namespace neuron
