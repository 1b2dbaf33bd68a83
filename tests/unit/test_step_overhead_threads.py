"""bench/step_overhead.py --threads reads each thread's CPU time and blocking from /proc: what
it sums, and what it leaves out (a thread that ends as it is read); and --first's table, which
gives the first step and the rest apart."""
import importlib.util
import pathlib

_PATH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "step_overhead.py"
_spec = importlib.util.spec_from_file_location("step_overhead", _PATH)
step_overhead = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step_overhead)


def _thread(task_dir, tid, name, cpu_ns, switches, schedstat=True):
    d = task_dir / str(tid)
    d.mkdir()
    (d / "comm").write_text(name + "\n")
    if schedstat:
        (d / "schedstat").write_text(f"{cpu_ns} 1234 56\n")
    (d / "status").write_text(f"Name:\t{name}\nvoluntary_ctxt_switches:\t{switches}\nnonvoluntary_ctxt_switches:\t9\n")


def test_each_thread_is_read_by_id_and_a_thread_ending_as_it_is_read_is_left_out(tmp_path):
    _thread(tmp_path, 10, "python", 5_000, 3)
    _thread(tmp_path, 11, "neuron_device", 7_000, 1)
    _thread(tmp_path, 12, "neuron_device", 2_000, 40)  # its OpenMP worker takes its name
    _thread(tmp_path, 13, "pt_autograd_0", 100, 2, schedstat=False)  # gone before its schedstat was read
    assert step_overhead.thread_times(str(tmp_path)) == {
        10: ("python", 5_000, 3), 11: ("neuron_device", 7_000, 1), 12: ("neuron_device", 2_000, 40)}


def test_per_step_figures_are_each_threads_difference_summed_by_name():
    before = {10: ("python", 1_000_000, 10), 11: ("neuron_device", 500_000, 0),
              12: ("neuron_device", 9_000_000, 5)}  # a worker of a team let go before `after`
    after = {10: ("python", 3_000_000, 30), 11: ("neuron_device", 800_000, 1),
             14: ("neuron_device", 100_000, 3)}  # the team's worker made again: from zero
    assert step_overhead.per_step(before, after, steps=10) == {
        "python": {"cpu_us": 200.0, "switches": 2.0, "threads": 1},
        "neuron_device": {"cpu_us": 40.0, "switches": 0.4, "threads": 2},
    }


def test_the_first_steps_table_gives_the_first_step_and_the_rest_apart_with_the_rests_ratio_to_eager():
    def run(first_step_ms, rest_ms):
        return {"wall_us": (first_step_ms + rest_ms) / 30 * 1e3, "first_step_ms": first_step_ms, "rest_ms": rest_ms}

    results = {(64, "cpu"): [run(10.0, 20.0)],
               (64, "eager"): [run(40.0, 20.0), run(60.0, 24.0), run(50.0, 22.0)],  # medians 50 and 22
               (64, "adaptive"): [run(45.0, 33.0)]}
    lines = step_overhead.first_steps_table(30, [64], results)
    assert lines[0].startswith("| width | mode | wall ms, first 30 steps |") and "steps 1-29 ms" in lines[0]
    assert lines[3] == "| 64 | eager | 72.0 | 1.00 | 2.40 | 50.0 | 22.0 | 1.00 |"  # median of each column on its own
    assert lines[4] == "| 64 | adaptive | 78.0 | 1.08 | 2.60 | 45.0 | 33.0 | 1.50 |"
