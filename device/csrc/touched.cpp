// Note [Gathers and scatters]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// An op is priced by the bytes it moves (Note [The Vector Engine floor], device/cost.py), and
// an op's bytes are its tensors' bytes, which for most ops is what it reads and writes. Not
// for indexing: a gather (index, index_select, embedding, gather, take) reads only the rows it
// picks, which are as many as its output holds, and an in-place scatter (index_copy_,
// index_add_, scatter_, scatter_add_, scatter_reduce_) touches only the rows its index names,
// however large the tensor it writes into. On the chip these are DMA descriptors per row,
// so the rest of the tensor never crosses HBM. Counted whole, a paged KV cache's update and
// its per-request gather cost as much as reading and writing the whole cache every layer and
// token (94% of a vLLM decode step's modelled time for a 2-layer model with a 32 MiB cache,
// growing with the cache, not with the tokens). Here the indexed tensor counts what is
// touched: the output's size for a gather; the index's (scatter) or source's (index_copy_,
// index_add_) size for a scatter, written, and read too when it accumulates.
#include "neuron.h"

#include <algorithm>
#include <string>

namespace neuron {
namespace {

double bytes_of(const at::Tensor& t) { return static_cast<double>(t.numel()) * t.element_size(); }

bool is_gather(const std::string& n) {
  return n == "aten::index" || n == "aten::index_select" || n == "aten::embedding" || n == "aten::gather" ||
         n == "aten::take";
}

}  // namespace

void count_touched_bytes(const c10::OperatorName& op, const std::vector<at::Tensor>& inputs, OpTraffic* traffic) {
  const std::string& n = op.name;
  if (inputs.empty()) {
    return;
  }
  const at::Tensor& self = inputs.front();  // the indexed tensor is the first argument of each
  if (is_gather(n)) {
    // Counted once, as an input: what is read of it is what the output holds.
    traffic->in_bytes -= bytes_of(self) - std::min(bytes_of(self), traffic->out_bytes);
    traffic->in_elements -= static_cast<double>(self.numel()) - std::min(static_cast<double>(self.numel()), traffic->out_elements);
    return;
  }
  const bool copies = n == "aten::index_copy_" || (n == "aten::scatter_" && op.overload_name != "reduce" &&
                                                   op.overload_name != "value_reduce");
  const bool accumulates = n == "aten::index_add_" || n == "aten::scatter_add_" || n == "aten::scatter_reduce_" ||
                           (n == "aten::scatter_" && !copies);
  if (!(copies || accumulates) || inputs.size() < 2) {
    return;
  }
  // index_copy_/index_add_(self, dim, index, source): the source's rows; scatter_*(self, dim,
  // index, src/value): one element per index entry.
  const bool by_source = n == "aten::index_copy_" || n == "aten::index_add_";
  const at::Tensor& touched_by = by_source ? inputs.back() : inputs[1];
  const double elements = std::min(static_cast<double>(touched_by.numel()), static_cast<double>(self.numel()));
  const double touched = elements * self.element_size();
  // self was counted whole as an input and as the (in-place) output.
  traffic->in_bytes -= bytes_of(self) - (accumulates ? touched : 0.0);
  traffic->in_elements -= static_cast<double>(self.numel()) - (accumulates ? elements : 0.0);
  traffic->out_bytes -= bytes_of(self) - touched;
  traffic->out_elements = std::min(traffic->out_elements, elements);
}

}  // namespace neuron
