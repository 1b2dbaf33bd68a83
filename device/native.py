"""The device's C++ core, `device._C` (device/csrc), compiled by `pip install` (setup.py).

Note [C++ device guard]: the device guard and PrivateUse1 hooks that C++ autograd and the
dispatcher call, and the current device (per thread, as on CUDA), live there. So do the
memory accounting and allocator (Note [Device memory accounting]) and the launch clock:
one set of numbers, whichever layer allocates or launches.
"""
from __future__ import annotations

try:
    from . import _C
except ImportError as exc:  # a source tree that was never installed, or a build for another torch
    raise ImportError(
        "adaptive-eager's C++ core (adaptive_eager/device/_C, compiled from device/csrc at install time) is missing "
        f"or does not load ({exc}). Install the project, which compiles it: pip install -e . "
        "(a C++ compiler is needed; torch is fetched for the build).") from exc

install = _C.install
install_refusing_guard = _C.install_refusing_guard  # a bad setting: Note [A bad setting fails at first use]
current_device = _C.current_device
set_current_device = _C.set_current_device
autograd_device_threads_may_run = _C.autograd_device_threads_may_run
# memory
memory_stats = _C.memory_stats
reset_peak = _C.reset_peak
set_memory_fraction = _C.set_memory_fraction
# clock
account_launch = _C.account_launch
transfer = _C.transfer
refund = _C.refund
counters = _C.counters
reset_counters = _C.reset_counters
set_spend_overhead = _C.set_spend_overhead
# streams and events
set_synchronizer = _C.set_synchronizer
# generators
host_generator = _C.host_generator
default_generator = _C.default_generator
draws_at_issue = _C.draws_at_issue
set_draw_hook = _C.set_draw_hook
drawing_from = _C.drawing_from
# the eager path and host aliases of device bytes
install_eager = _C.install_eager
set_collective_costs = _C.set_collective_costs  # Note [Collectives on the link]
wait_for_device = _C.wait_for_device
device_idle = _C.device_idle
device_jobs_queued = _C.device_jobs_queued
sleep_on_device = _C.sleep_on_device  # tests: the device behind the host
set_handover_pause = _C.set_handover_pause  # tests: Note [The device holds no caller's storage]
draws_random_numbers = _C.draws_random_numbers  # Note [Seeded ops that never draw]
PeriodDetector = _C.PeriodDetector  # engine/period_detector.cpp (adaptive_eager/engine/detector.py)
PERIOD_DETECTOR_RECENT = _C.PERIOD_DETECTOR_RECENT
add_internal_source_dir = _C.add_internal_source_dir
set_launch_blocking = _C.set_launch_blocking
set_executor_spin = _C.set_executor_spin
set_device_team_sleeps = _C.set_device_team_sleeps
eager_issue_counts = _C.eager_issue_counts
host_alias = _C.host_alias
adopt = _C.adopt
# projection mode: Note [Projected bytes] (csrc/runtime/memory.cpp), Note [Projected ops]
set_projection = _C.set_projection
projection_enabled = _C.projection_enabled
is_projected = _C.is_projected
bytes_holders = _C.bytes_holders  # tests: Note [Shares count their holders in one step]
has_bytes = _C.has_bytes  # tests: Note [A deferred output's bytes exist at issue]
output_bytes_counts = _C.output_bytes_counts  # tests: Note [A kernel's results are made in their outputs' bytes]
placeholder_reads = _C.placeholder_reads
adopt_meta = _C.adopt_meta
forget_values = _C.forget_values
# scaled_dot_product_attention's kernel (dispatch/attention.py)
validate_sdpa_input = _C.validate_sdpa_input  # Note [SDPA's input checks]
host_sdp_choice = _C.host_sdp_choice  # Note [The overrideable SDPA backend]
device_sdp_choice = _C.device_sdp_choice  # the same, shadows made in C++ (dispatch/attention.py)
# the adaptive engine's route and queue (csrc/engine/queue.cpp, csrc/engine/route.cpp)
RUN_EAGER = _C.RUN_EAGER
DeferPlan = _C.DeferPlan
pointwise_geometry = _C.pointwise_geometry
set_engine = _C.set_engine
set_host_sync = _C.set_host_sync
offer = _C.offer
PositionGuards = _C.PositionGuards  # Note [A position's guards in C++]
route_call = _C.route_call
GuardTable = _C.GuardTable  # Note [Armed matching]
FeedKeys = _C.FeedKeys  # Note [Detection fed by the route]
arm = _C.arm
disarm = _C.disarm
set_stream_allowed = _C.set_stream_allowed
armed_matches = _C.armed_matches
note_producer = _C.note_producer
storage_of = _C.storage_of
producer_of = _C.producer_of
forget_producers = _C.forget_producers
set_bypass = _C.set_bypass
run_queue = _C.run_queue
queue_size = _C.queue_size
host_sync = _C.host_sync
FusedLaunch = _C.FusedLaunch
set_launch_log = _C.set_launch_log
take_launch_log = _C.take_launch_log
set_op_log = _C.set_op_log
covered_third_party_composites = _C.covered_third_party_composites
take_op_log = _C.take_op_log
timeline_recording = _C.timeline_recording
label_next_launch = _C.label_next_launch
queued_ops = _C.queued_ops
last_fused_launch = _C.last_fused_launch
submit_queue = _C.submit_queue
stream_next = _C.stream_next
queue_streamed = _C.queue_streamed
forced_seals = _C.forced_seals
set_streamed_launches = _C.set_streamed_launches
streamed_launches = _C.streamed_launches
launch_in_flight = _C.launch_in_flight
launches_in_flight = _C.launches_in_flight
STREAM_DEPTH = _C.STREAM_DEPTH
launch_finished = _C.launch_finished
oldest_launch_ended = _C.oldest_launch_ended
finish_launch = _C.finish_launch
failed_index = _C.failed_index
set_failure = _C.set_failure
