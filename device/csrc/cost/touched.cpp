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

#include <ATen/ExpandUtils.h>

#include <algorithm>
#include <string>
#include <unordered_map>

namespace neuron {
namespace {

double bytes_of(const at::Tensor& t) { return static_cast<double>(t.numel()) * t.element_size(); }

// How an op touches its first argument, the indexed tensor. A scatter's touched rows are its
// source's (index_copy_/index_add_(self, dim, index, source)) or one per index entry
// (scatter_*(self, dim, index, src/value)); an accumulating one reads them too. An index put
// writes what its indices name (Note [Index puts]).
enum class Indexing { kGather, kWriteSourceRows, kAddSourceRows, kWriteIndexed, kAddIndexed, kPut };

const std::unordered_map<std::string, Indexing> kIndexing = {
    {"aten::index", Indexing::kGather},           {"aten::index_select", Indexing::kGather},
    {"aten::embedding", Indexing::kGather},       {"aten::gather", Indexing::kGather},
    {"aten::take", Indexing::kGather},            {"aten::index_copy_", Indexing::kWriteSourceRows},
    {"aten::index_add_", Indexing::kAddSourceRows}, {"aten::scatter_", Indexing::kWriteIndexed},
    {"aten::scatter_add_", Indexing::kAddIndexed}, {"aten::scatter_reduce_", Indexing::kAddIndexed},
    {"aten::_index_put_impl_", Indexing::kPut},  // x[idx] = v: what index_put_ reaches the device as
};

// self was counted whole as an input and as the (in-place) output; it touches `elements`.
void count_written_elements(const at::Tensor& self, double elements, bool accumulates, OpTraffic* traffic) {
  elements = std::min(elements, static_cast<double>(self.numel()));
  const double touched = elements * self.element_size();
  traffic->in_bytes -= bytes_of(self) - (accumulates ? touched : 0.0);
  traffic->in_elements -= static_cast<double>(self.numel()) - (accumulates ? elements : 0.0);
  traffic->out_bytes -= bytes_of(self) - touched;
  traffic->out_elements = std::min(traffic->out_elements, elements);
}

// Note [Index puts]
// ~~~~~~~~~~~~~~~~~
// x[idx] = v (_index_put_impl_(self, indices, values, accumulate, unsafe)) writes the elements
// its indices name, as a scatter does (Note [Gathers and scatters]): the broadcast of its index
// tensors times the sizes of the dims no index names (None entries, trailing dims). A boolean
// mask names its dims and as many elements as it has True entries, which are data: it counts
// as all of them, the most it can write. Read from the arguments before the op runs: its host
// index tensors are not among the device inputs. Counted whole, a KV cache updated by setitem
// cost a write of the whole cache per token. < 0: indices that do not broadcast (the kernel
// says so; the op is priced whole meanwhile).
double index_put_elements(const torch::jit::Stack& stack, size_t first) {
  if (!stack[first].isTensor() || !stack[first + 1].isList()) {
    return -1;
  }
  const at::Tensor& self = stack[first].toTensor();
  std::vector<bool> named(static_cast<size_t>(self.dim()), false);
  std::vector<int64_t> broadcast;
  size_t dim = 0;
  for (const c10::IValue& entry : stack[first + 1].toListRef()) {
    const at::Tensor index = entry.isTensor() ? entry.toTensor() : at::Tensor();
    if (!index.defined()) {  // None: the whole dim
      ++dim;
      continue;
    }
    const bool mask = index.scalar_type() == at::kBool || index.scalar_type() == at::kByte;
    const size_t dims = mask ? static_cast<size_t>(index.dim()) : 1;
    for (size_t k = 0; k < dims && dim < named.size(); ++k) {
      named[dim++] = true;
    }
    const std::vector<int64_t> shape = mask ? std::vector<int64_t>{index.numel()} : index.sizes().vec();
    try {
      broadcast = at::infer_size(broadcast, shape);
    } catch (const c10::Error&) {
      return -1;
    }
  }
  double elements = 1;
  for (const int64_t n : broadcast) {
    elements *= static_cast<double>(n);
  }
  for (size_t d = 0; d < named.size(); ++d) {
    if (!named[d]) {
      elements *= static_cast<double>(self.size(static_cast<int64_t>(d)));
    }
  }
  return elements;
}

}  // namespace

Touch touch_of(const c10::OperatorName& op, const torch::jit::Stack& stack, size_t first) {
  Touch touch;
  const auto found = kIndexing.find(op.name);  // one lookup per op: most ops stop here
  if (found == kIndexing.end()) {
    return touch;
  }
  Indexing kind = found->second;
  if (kind == Indexing::kWriteIndexed && (op.overload_name == "reduce" || op.overload_name == "value_reduce")) {
    kind = Indexing::kAddIndexed;  // scatter_(..., reduce=...) accumulates
  }
  if (kind == Indexing::kPut) {
    touch.put_elements = index_put_elements(stack, first);
    if (touch.put_elements < 0) {
      return touch;
    }
    touch.accumulates = stack[first + 3].isBool() && stack[first + 3].toBool();
  }
  touch.kind = static_cast<int>(kind);
  return touch;
}

void count_touched_bytes(const Touch& touch, c10::ArrayRef<at::Tensor> inputs, OpTraffic* traffic) {
  if (touch.kind < 0 || inputs.empty()) {
    return;
  }
  const auto kind = static_cast<Indexing>(touch.kind);
  const at::Tensor& self = inputs.front();
  if (kind == Indexing::kPut) {
    count_written_elements(self, touch.put_elements, touch.accumulates, traffic);
    return;
  }
  if (kind == Indexing::kGather) {
    // Counted once, as an input: what is read of it is what the output holds.
    traffic->in_bytes -= bytes_of(self) - std::min(bytes_of(self), traffic->out_bytes);
    traffic->in_elements -= static_cast<double>(self.numel()) - std::min(static_cast<double>(self.numel()), traffic->out_elements);
    return;
  }
  if (inputs.size() < 2) {
    return;
  }
  const bool by_source = kind == Indexing::kWriteSourceRows || kind == Indexing::kAddSourceRows;
  const bool accumulates = kind == Indexing::kAddSourceRows || kind == Indexing::kAddIndexed;
  const at::Tensor& touched_by = by_source ? inputs.back() : inputs[1];
  count_written_elements(self, static_cast<double>(touched_by.numel()), accumulates, traffic);
}

}  // namespace neuron
