"""The process's CPU math is steady once the device is installed: MKL's vector math (VML) is
set up before any kernel, so no two threads' first calls race (Note [MKL's vector math starts
racily], device/csrc/runtime/host_math.cpp)."""
from subproc import result_of, start_json

# Each child does what raced: its first VML call, from two OpenMP threads at once. Without the
# set-up, 1 child in 10 (1 in 5 under load) gave other bits on one thread's chunk; children run
# two at a time, which loads the machine the way that made the race likelier. 16 children find a
# return of the race about 4 times in 5; none may find it while the set-up is in place.
_FIRST_VML_CALL = """
    import torch  # the device registers itself here (torch's backend autoload)
    torch.set_num_threads(2)
    x = torch.linspace(0.5, 2.0, 8192)  # 4,096 per thread: above ATen's grain, so both threads run
    first, later = torch.sqrt(x), torch.sqrt(x)
    emit(torch.equal(first, later))
"""


def test_first_two_thread_vector_math_call_matches_later_calls_in_fresh_processes():
    same = []
    for _ in range(8):
        pair = [start_json(_FIRST_VML_CALL) for _ in range(2)]
        same += [result_of(child) for child in pair]
    assert all(same), f"{same.count(False)} of {len(same)} fresh processes' first sqrt differed from their second"
