// The adaptive engine's period detector (period_detector.cpp has its definitions and Note):
// declared here for the route (route.cpp), which feeds it the ops it matches while armed
// (Note [Detection fed by the route] in route.cpp).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <deque>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

namespace neuron {

constexpr size_t kPeriodRecent = 8;  // recent positions kept per key

class PeriodDetector {
 public:
  PeriodDetector(int64_t min_len, int64_t max_len, int64_t repeats, std::optional<int64_t> unit_min);

  int64_t position() const { return base_ + static_cast<int64_t>(keys_.size()); }

  // Adds one op's key; the period that just fired (the longest primitive one), if any.
  std::optional<int64_t> push(int64_t key);

  // The longest run of any live candidate period: how long the stream has repeated.
  int64_t longest_run() const;

  // Drops every live run (after a disruption the stream must repeat afresh).
  void forget();

  // Fires `period` once more if its run goes on for `after` more ops.
  void fire_again(int64_t period, int64_t after);

  // For tests of its bounds: the live runs, how many keys it keeps, the most positions kept
  // for one key.
  std::vector<std::pair<int64_t, int64_t>> live_runs() const { return runs_; }
  int64_t kept_keys() const { return static_cast<int64_t>(keys_.size()); }
  int64_t most_recent_positions() const;

  const int64_t min_len_, unit_min_, max_len_, repeats_;

 private:
  static bool has_run(const std::vector<std::pair<int64_t, int64_t>>& runs, int64_t p);

  std::vector<int64_t> keys_;
  int64_t base_ = 0;  // stream position of keys_[0]
  std::unordered_map<int64_t, std::deque<int64_t>> last_;
  // (period, run) in the order they were seeded, as few as a few dozen: a vector beats a map
  std::vector<std::pair<int64_t, int64_t>> runs_, next_;
  std::unordered_map<int64_t, int64_t> again_;  // period -> the run length at which it fires again
  std::vector<int64_t> fired_;
};

}  // namespace neuron
