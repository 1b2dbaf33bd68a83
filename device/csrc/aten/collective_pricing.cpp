// Note [Collectives on the link]: a c10d collective on neuron tensors is one launch, priced as
// the chip's collective engines would spend it rather than as an op over HBM. The algorithms are
// rings over the group's N ranks (the Neuron runtime's Ring/KangaRing, NCCL's ring), each rank
// sending over its share of the link, reductions on the DMA engines' collective compute:
//
//   | op | link hops | bytes on the wire | bytes reduced | S |
//   |---|---|---|---|---|
//   | all-reduce | 2(N-1) | 2(N-1)/N x S | (N-1)/N x S | the tensors' bytes |
//   | all-gather | N-1 | (N-1)/N x S | - | the gathered output's bytes |
//   | reduce-scatter | N-1 | (N-1)/N x S | (N-1)/N x S | the input's bytes |
//   | all-to-all | N-1 | (N-1)/N x S | - | the input's bytes |
//   | broadcast | N-1 | S (a pipelined chain) | - | the tensors' bytes |
//   | reduce | N-1 | S | S | the tensors' bytes |
//   | gather, scatter | N-1 | (N-1)/N x S | - | all ranks' pieces: N x one rank's |
//   | send, recv | 1 | S | - | the tensors' bytes |
//   | barrier | 2(N-1) | - | - | - |
//
// time = hops x hop latency + wire bytes / the rank's link rate + reduced bytes / the reduce rate.
// The figures, with their sources, are the device profile's (device/profiles.py, DeviceProfile's
// collective fields; device/cost.py, CostModel.collective_costs): a rank's link rate is its share
// of its chip's NeuronLink while the group fits one scale-up domain (a trn2.48xlarge's 16 chips,
// a Trn3 Gen1 UltraServer's 64), else its share of the instance's EFA.
//
// What the model leaves out, so that a projection says what it is: which ranks a group holds (a
// group is taken as consecutive ranks, as torchrun and DeviceMesh lay out a mesh's innermost
// dimension; an outer dimension's group across instances is priced as if it were packed), waiting
// for the slowest rank (each rank's clock advances by its own program: a symmetric step is not
// affected), overlap of communication with compute (a collective is a launch on the device's one
// queue, Note [One queue per device]), and hierarchical or tree algorithms. The same model prices
// a collective with bytes (gloo moves them on the host) and in projection (none move: Note
// [Projected collectives] in collectives.cpp), so both give the same clock.
#include "aten/eager_internal.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace neuron {
namespace eager_detail {
namespace {

CollectiveCosts g_costs{};  // written once, at install (device/runtime.py)

enum class Algorithm { kAllReduce, kAllGather, kReduceScatter, kAllToAll, kBroadcast, kReduce, kGather, kPointToPoint, kBarrier };

struct Collective {
  const char* sized_by;  // the argument whose bytes are S (nullptr: none)
  Algorithm algorithm;
};

const std::unordered_map<std::string, Collective>& collectives() {
  static const std::unordered_map<std::string, Collective> table = {
      {"c10d::allreduce_", {"tensors", Algorithm::kAllReduce}},
      {"c10d::allreduce_coalesced_", {"tensors", Algorithm::kAllReduce}},
      {"c10d::allgather_", {"output_tensors", Algorithm::kAllGather}},
      {"c10d::_allgather_base_", {"output_tensor", Algorithm::kAllGather}},
      {"c10d::allgather_coalesced_", {"output_lists", Algorithm::kAllGather}},
      {"c10d::allgather_into_tensor_coalesced_", {"outputs", Algorithm::kAllGather}},
      {"c10d::reduce_scatter_", {"input_tensors", Algorithm::kReduceScatter}},
      {"c10d::_reduce_scatter_base_", {"input_tensor", Algorithm::kReduceScatter}},
      {"c10d::reduce_scatter_tensor_coalesced_", {"inputs", Algorithm::kReduceScatter}},
      {"c10d::alltoall_", {"input_tensors", Algorithm::kAllToAll}},
      {"c10d::alltoall_base_", {"input", Algorithm::kAllToAll}},
      {"c10d::broadcast_", {"tensors", Algorithm::kBroadcast}},
      {"c10d::reduce_", {"tensors", Algorithm::kReduce}},
      {"c10d::gather_", {"input_tensors", Algorithm::kGather}},
      {"c10d::scatter_", {"output_tensors", Algorithm::kGather}},
      {"c10d::send", {"tensors", Algorithm::kPointToPoint}},
      {"c10d::recv_", {"tensors", Algorithm::kPointToPoint}},
      {"c10d::recv_any_source_", {"tensors", Algorithm::kPointToPoint}},
      {"c10d::barrier", {nullptr, Algorithm::kBarrier}},
      {"c10d::monitored_barrier_", {nullptr, Algorithm::kBarrier}},
  };
  return table;
}

double bytes_of(const c10::IValue& v) {
  double bytes = 0;
  for (const at::Tensor& t : tensors_of(v)) {
    if (t.defined()) {
      bytes += static_cast<double>(t.numel()) * static_cast<double>(t.element_size());
    }
  }
  return bytes;
}

}  // namespace

bool is_priced_collective(const c10::OperatorName& name) { return collectives().count(name.name) > 0; }

std::optional<double> collective_us(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first) {
  const c10::FunctionSchema& schema = op.schema();
  const auto it = collectives().find(schema.operator_name().name);
  if (it == collectives().end()) {
    return std::nullopt;
  }
  const int group_arg = argument_index(schema, "process_group");
  TORCH_CHECK(group_arg >= 0, "internal error: ", schema.operator_name().name, " without its process group");
  const double n = static_cast<double>(stack[first + group_arg].toCustomClass<c10d::ProcessGroup>()->getSize());
  const Collective& c = it->second;
  double s = 0;
  if (c.sized_by != nullptr) {
    const int arg = argument_index(schema, c.sized_by);
    TORCH_CHECK(arg >= 0, "internal error: ", schema.operator_name().name, " without its argument ", c.sized_by);
    s = bytes_of(stack[first + arg]);
  }
  if (n <= 1) {
    return 0.0;  // nothing to meet: the launch alone
  }
  const double share = (n - 1) / n;
  double hops = n - 1, wire = share * s, reduced = 0;
  switch (c.algorithm) {
    case Algorithm::kAllReduce:
      hops = 2 * (n - 1);
      wire = 2 * share * s;
      reduced = share * s;
      break;
    case Algorithm::kReduceScatter:
      reduced = share * s;
      break;
    case Algorithm::kAllGather:
    case Algorithm::kAllToAll:
      break;
    case Algorithm::kGather:
      wire = share * n * s;  // S is one rank's piece here
      break;
    case Algorithm::kBroadcast:
      wire = s;
      break;
    case Algorithm::kReduce:
      wire = s;
      reduced = s;
      break;
    case Algorithm::kPointToPoint:
      hops = 1;
      wire = s;
      break;
    case Algorithm::kBarrier:
      hops = 2 * (n - 1);
      wire = 0;
      break;
  }
  const double us_per_byte = n <= static_cast<double>(g_costs.ranks_per_domain) ? g_costs.link_us_per_byte
                                                                                : g_costs.efa_us_per_byte;
  return hops * g_costs.hop_us + wire * us_per_byte + reduced * g_costs.reduce_us_per_byte;
}

double launch_collective(c10::DeviceIndex d, const std::string& name, double us) {
  log_op(name, us);
  return launch(d, us, 1, name);
}

}  // namespace eager_detail

void set_collective_costs(const CollectiveCosts& costs) { eager_detail::g_costs = costs; }

}  // namespace neuron
