// The adaptive engine's period detector (adaptive_eager/engine/detector.py documents it and
// its Notes): the repeating unit of the op stream, found incrementally without markers. In
// C++ because it runs on every op while the engine records or detects (twice: exact keys and
// size-erased keys), where its Python form cost ~2 us a push (bench/bench_detector.py).
//
// Each op is one interned key. For every live candidate period p the run length of positions
// t with key[t] == key[t - p]; candidates are seeded from the last kRecent positions of the
// current key. When a run reaches (repeats - 1) * p the last p ops have been seen `repeats`
// times in a row: the period fires (once; again only where the engine asks, fire_again).
#include "engine/period_detector.h"

#include <algorithm>

namespace neuron {

PeriodDetector::PeriodDetector(int64_t min_len, int64_t max_len, int64_t repeats, std::optional<int64_t> unit_min)
    : min_len_(min_len), unit_min_(unit_min.value_or(min_len)), max_len_(max_len), repeats_(repeats) {
  TORCH_CHECK(min_len >= 1 && max_len >= 1 && repeats >= 2, "PeriodDetector needs min_len >= 1, max_len >= 1 "
              "and repeats >= 2, got ", min_len, ", ", max_len, ", ", repeats);
}

std::optional<int64_t> PeriodDetector::push(int64_t key) {
  const int64_t i = position();
  next_.clear();
  for (const auto& [p, r] : runs_) {
    const int64_t j = i - p - base_;
    if (j >= 0 && keys_[j] == key) {
      next_.emplace_back(p, r + 1);
    }
  }
  auto& recent = last_[key];
  for (const int64_t j : recent) {
    const int64_t p = i - j;
    if (p <= max_len_ && !has_run(next_, p)) {
      next_.emplace_back(p, 1);
    }
  }
  recent.push_back(i);
  if (recent.size() > kPeriodRecent) {
    recent.pop_front();
  }
  std::swap(runs_, next_);
  keys_.push_back(key);
  if (static_cast<int64_t>(keys_.size()) > 2 * repeats_ * max_len_) {
    const size_t drop = keys_.size() / 2;
    keys_.erase(keys_.begin(), keys_.begin() + static_cast<std::ptrdiff_t>(drop));
    base_ += static_cast<int64_t>(drop);
  }
  const int64_t need = repeats_ - 1;
  fired_.clear();
  for (const auto& [p, r] : runs_) {
    if (p < min_len_) {
      continue;
    }
    bool fires = r == p * need;
    if (!again_.empty()) {
      auto it = again_.find(p);
      if (it != again_.end() && it->second == r) {
        fires = true;
      }
    }
    if (fires) {
      fired_.push_back(p);
    }
  }
  for (const int64_t p : fired_) {
    again_.erase(p);
  }
  // The longest primitive period: p is not a new unit if its window is a shorter unit q
  // repeated (q divides p and the window is q-periodic), or if the stream has been
  // q-periodic for all of the last p ops (q-periodic stretches fire every p; a step that
  // merely ends in a repeated pair, or shares a few ops with its start, does not).
  std::optional<int64_t> best;
  for (const int64_t p : fired_) {
    bool primitive = true;
    for (const auto& [q, r] : runs_) {
      if (unit_min_ <= q && q < p && (r >= p || (p % q == 0 && r >= p - q))) {
        primitive = false;
        break;
      }
    }
    if (primitive && (!best || p > *best)) {
      best = p;
    }
  }
  return best;
}

int64_t PeriodDetector::longest_run() const {
  int64_t longest = 0;
  for (const auto& run : runs_) {
    longest = std::max(longest, run.second);
  }
  return longest;
}

void PeriodDetector::forget() {
  runs_.clear();
  again_.clear();
}

void PeriodDetector::fire_again(int64_t period, int64_t after) {
  for (const auto& [p, r] : runs_) {
    if (p == period) {
      again_[p] = r + after;
      return;
    }
  }
}

int64_t PeriodDetector::most_recent_positions() const {
  size_t most = 0;
  for (const auto& entry : last_) {
    most = std::max(most, entry.second.size());
  }
  return static_cast<int64_t>(most);
}

bool PeriodDetector::has_run(const std::vector<std::pair<int64_t, int64_t>>& runs, int64_t p) {
  for (const auto& run : runs) {
    if (run.first == p) {
      return true;
    }
  }
  return false;
}

}  // namespace neuron

void bind_period_detector(py::module_& m) {
  using neuron::PeriodDetector;
  py::class_<PeriodDetector>(m, "PeriodDetector")
      .def(py::init<int64_t, int64_t, int64_t, std::optional<int64_t>>(), py::arg("min_len"), py::arg("max_len"),
           py::arg("repeats") = 2, py::arg("unit_min") = py::none())
      .def_property_readonly("position", &PeriodDetector::position, "stream position of the next key")
      .def("push", &PeriodDetector::push, py::arg("key"),
           "add one op's key; returns the period that just fired (the longest primitive one), or None")
      .def("longest_run", &PeriodDetector::longest_run)
      .def("forget", &PeriodDetector::forget)
      .def("fire_again", &PeriodDetector::fire_again, py::arg("period"), py::arg("after"))
      .def("live_runs", [](const PeriodDetector& d) {
        py::dict runs;
        for (const auto& [p, r] : d.live_runs()) {
          runs[py::int_(p)] = r;
        }
        return runs;
      })
      .def("kept_keys", &PeriodDetector::kept_keys)
      .def("most_recent_positions", &PeriodDetector::most_recent_positions)
      .def_readonly("min_len", &PeriodDetector::min_len_)
      .def_readonly("unit_min", &PeriodDetector::unit_min_)
      .def_readonly("max_len", &PeriodDetector::max_len_)
      .def_readonly("repeats", &PeriodDetector::repeats_);
  m.attr("PERIOD_DETECTOR_RECENT") = static_cast<int64_t>(neuron::kPeriodRecent);
}
