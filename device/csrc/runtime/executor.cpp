// Note [The device executor]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// The emulated device runs its kernels on a thread of its own, as a real accelerator runs them
// on its own cores: one in-order queue of jobs for the process, one thread that runs them.
// The user's threads and autograd's thread for the device only issue (aten/issue.cpp): an op
// whose outputs' geometry is known is posted and the host runs ahead (post_to_device); any
// other waits for its own run (run_on_device). Host reads, synchronize() and the like wait
// for the queue to empty (wait_for_device), and raise there the first error an op posted
// without a wait met, as CUDA raises an asynchronous error at the next sync.
//
// Why a thread of its own, and not the issuing one: every thread that enters an OpenMP region
// keeps a thread team, and libgomp counts all teams' threads; once they outnumber the cores it
// stops spinning between regions (its "throttled" spin), and every later region of every
// team wakes its workers through the kernel: a 16x64 CPU matmul took 6 us before a neuron
// backward and 120-145 us after it, in the same process, because autograd's device thread
// kept a team. Kernels on one thread make one team (whose idle workers can be asked to sleep
// rather than spin: Note [The device's team sleeps between regions]); and the executor lets
// its team go when it has been idle a moment (Note [The executor's idle team]), so a process
// that stops using the device gets its CPU kernels' speed back.
#include "neuron.h"

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <c10/util/Exception.h>

#include <Python.h>
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace neuron {
namespace {

// Note [The executor's idle team]: libgomp frees a thread's team only when the thread exits,
// or when it asks with omp_pause_resource_all (OpenMP 5.0). Looked up at run time: a torch
// built with another OpenMP runtime may not have it, and then the team stays.
constexpr auto kIdleBeforeRelease = std::chrono::milliseconds(2);
using PauseFn = int (*)(int);
constexpr int kOmpPauseSoft = 1;

PauseFn omp_pause() {
  static const PauseFn fn = reinterpret_cast<PauseFn>(dlsym(RTLD_DEFAULT, "omp_pause_resource_all"));
  return fn;
}

// Note [A released team and fork]: omp_pause_resource_all returns once the team's workers
// have left their last barrier, but they exit on their own time after it, and an exiting
// worker runs MKL's thread-exit cleanup, which holds MKL's memory manager's lock. A fork in
// that moment hands the child the lock held by a thread the child does not have: its first
// matmul spins for ever (6 hangs in 12 runs of a fork right after a launch). So a release
// holds g_release, and fork (the prepare handler below) takes it and then waits for the
// process's thread count to settle after a recent release: no worker is exiting as it forks.
std::mutex g_release;
std::chrono::steady_clock::time_point g_last_release;  // under g_release
constexpr auto kReleaseSettles = std::chrono::milliseconds(20);  // exits take microseconds
constexpr auto kSettledFor = std::chrono::milliseconds(1);

void release_team() {
  const std::lock_guard<std::mutex> guard(g_release);
  omp_pause()(kOmpPauseSoft);
  g_last_release = std::chrono::steady_clock::now();
}

// The process's thread count, from /proc (-1 where there is none).
int process_thread_count() {
  FILE* stat = std::fopen("/proc/self/stat", "r");
  if (stat == nullptr) {
    return -1;
  }
  char text[1024];
  const size_t n = std::fread(text, 1, sizeof(text) - 1, stat);
  std::fclose(stat);
  text[n] = '\0';
  // Field 20 (num_threads); the name in field 2 may hold spaces, so count from its ')'.
  const char* at = std::strrchr(text, ')');
  for (int field = 2; at != nullptr && field < 20; ++field) {
    at = std::strchr(at + 1, ' ');
  }
  return at == nullptr ? -1 : std::atoi(at + 1);
}

void settle_released_teams() {
  g_release.lock();  // held through the fork: no release starts; unlocked in parent and child
  const auto start = std::chrono::steady_clock::now();
  if (start - g_last_release > kReleaseSettles) {
    return;
  }
  int count = process_thread_count();
  auto changed = start;
  while (count >= 0) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
    const auto now = std::chrono::steady_clock::now();
    const int later = process_thread_count();
    if (later != count) {
      count = later;
      changed = now;
    } else if (now - changed >= kSettledFor || now - start >= kReleaseSettles) {
      return;
    }
  }
}

// Note [The device's team sleeps between regions]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The executor's team has the host's thread count, which is the core count unless the user
// set another. After each parallel region libgomp's workers spin for their next one, ~3 ms
// by default, and so the executor's idle worker can take the core the host thread needs to
// issue the next op. libgomp spins only 100 pauses before it sleeps once the threads it
// manages outnumber the cores (OMP_WAIT_POLICY's default). With NEURON_DEVICE_TEAM_SLEEPS=1,
// while the host keeps its thread busy (the host-bound regime: it issues, the device keeps
// up) and the device's team with the host thread would want more cores than the process has,
// a thread of ours keeps one more idle team (one worker, asleep): the process's teams then
// wake their workers through the kernel at every region, and the host keeps its core. Where
// the host waits for the device (big ops: a sync, a host read, an op that waits for its own
// run) it needs no core, and a futex wake per region costs the device more than a spinning
// worker costs anyone: the held team is let go while the host waited for more than
// kWaitedSpins of the last window (kWindow), and taken again when it waits less than
// kWaitedSleeps of one. It is let go with the executor's team, too (Note [The executor's idle
// team]); the team made at the next job follows the last window's verdict.
//
// Off by default: measured alone, the held team costs more than it saves. Its commit had
// measured eager 2.03x -> 1.24x CPU's wall time on a width-64 MLP step, but that commit also
// removed the parked team (workers held in a region of ours while the queue was empty), and
// on 2026-12-07 (2-core AMD EPYC VM, bench/step_overhead.py, each mode in its own process,
// modes interleaved, CPU 600 us at width 64 and 830 at 256) the held team alone read, held
// against libgomp's own spin: width 64 eager 1,436 / 976 us a step, adaptive 892 / 791; width
// 256 eager 2,163 / 1,106, adaptive 2,391 / 1,049; width 1024 eager 7,049 / 5,726, adaptive
// 7,875 / 7,381 (5 rounds, medians); and in 6 alternated pairs of fresh processes, width 64
// eager 1,100 / 898, adaptive 789 / 1,070 (held: 644-1,551), width 256 eager 2,100 / 1,220,
// adaptive 2,373 / 1,113. On this machine a sleeping worker's wake costs tens of
// microseconds per region, ~20 regions a step (MKL's sgemm, oneDNN's GELU, log_softmax). A
// worker that never spins at all does best at width 64 (GOMP_SPINCOUNT=0: eager 620-650,
// adaptive 580-710), worst at 256 (1,864 / 2,310), and slows the same process's CPU kernels
// 3x; libgomp reads its spin once, at load, for every team, so that is the user's to choose.
// Set OMP_WAIT_POLICY (or GOMP_SPINCOUNT) and libgomp does what it says: no team is held.
constexpr auto kWindow = std::chrono::milliseconds(20);
constexpr double kWaitedSpins = 0.3;
constexpr double kWaitedSleeps = 0.1;

using ParallelFn = void (*)(void (*)(void*), void*, unsigned, unsigned);

ParallelFn gomp_parallel() {
  static const ParallelFn fn = reinterpret_cast<ParallelFn>(dlsym(RTLD_DEFAULT, "GOMP_parallel"));
  return fn;
}

int process_cores() {
  cpu_set_t set;
  return sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
}

bool wait_policy_set() {
  return std::getenv("OMP_WAIT_POLICY") != nullptr || std::getenv("GOMP_SPINCOUNT") != nullptr;
}

std::atomic<bool> g_team_sleeps{false};  // NEURON_DEVICE_TEAM_SLEEPS

struct SleepingTeams {
  std::mutex lock;
  std::condition_variable changed;
  bool want = false;  // under lock
  bool started = false;

  // Whether a team of `threads` beside the host thread wants more cores than the process has,
  // and the user asked for its workers to sleep (NEURON_DEVICE_TEAM_SLEEPS=1).
  static bool needed(int threads) {
    static const bool policy = wait_policy_set();
    static const int cores = process_cores();
    return g_team_sleeps.load(std::memory_order_relaxed) && !policy && threads > 1 && threads >= cores &&
           gomp_parallel() != nullptr && omp_pause() != nullptr;
  }

  void hold(bool on) {
    const std::lock_guard<std::mutex> guard(lock);
    if (want == on) {
      return;
    }
    want = on;
    if (!started) {
      started = true;
      std::thread([this] { loop(); }).detach();  // waits for the process's life, as the executor
    }
    changed.notify_all();
  }

  void loop() {
    pthread_setname_np(pthread_self(), "neuron_idle_omp");  // and its idle worker
    bool held = false;
    for (;;) {
      {
        std::unique_lock<std::mutex> guard(lock);
        changed.wait(guard, [&] { return want != held; });
        held = want;
      }
      if (held) {
        gomp_parallel()([](void*) {}, nullptr, 2, 0);  // this thread's team: one worker, idle
      } else {
        release_team();
      }
    }
  }
};

// Never destroyed, as the executor (below).
SleepingTeams* g_sleeping = new SleepingTeams;

// Note [The executor spins before it sleeps]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A host issuing small ops keeps the executor a little ahead of it: each op runs in a few
// microseconds and the next arrives some microseconds later. Sleeping on a condition variable
// in between costs both sides a system call per op (the host's wake, the executor's sleep) and
// the executor's wake-up latency at every op, and a streamed launch's executor, which is woken
// only every few entries to spare the host those calls, was still that many entries behind at
// a host read (a generate() token waited for them: adaptive mode's wall time above eager's).
// So before it sleeps the executor watches its queue for a moment, as CUDA's default
// synchronisation spins while the host has a core to spare, and only then sleeps.
// NEURON_EXECUTOR_SPIN_US sets the moment (0: sleep at once); past its first microseconds the
// executor yields its core between looks, so the spin costs only a core no thread wants.
std::atomic<int64_t> g_spin_us{200};

constexpr auto kSpinBeforeYield = std::chrono::microseconds(10);

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace

void set_executor_spin(int64_t microseconds) { g_spin_us.store(microseconds); }

void set_device_team_sleeps(bool sleeps) { g_team_sleeps.store(sleeps); }

void spin_for_change(std::unique_lock<std::mutex>& guard, const std::atomic<uint64_t>& changes, uint64_t seen) {
  const auto budget = std::chrono::microseconds(g_spin_us.load(std::memory_order_relaxed));
  if (budget.count() <= 0) {
    return;
  }
  guard.unlock();
  const auto changed = [&] { return changes.load(std::memory_order_acquire) != seen; };
  const auto start = std::chrono::steady_clock::now();
  const auto end = start + budget;
  const auto polite = start + kSpinBeforeYield;
  while (!changed()) {
    for (int i = 0; i < 64 && !changed(); ++i) {
      cpu_relax();
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= end) {
      break;
    }
    if (now >= polite) {
      // Past the first moment, the core goes to any other thread that wants it between looks
      // (a rank's host thread, a DataLoader worker).
      std::this_thread::yield();
    }
  }
  guard.lock();
}

namespace {

struct Job {
  std::function<void()> run;  // never throws: post_to_device and run_on_device wrap it
  int threads = 1;
};

thread_local bool t_on_executor = false;
std::atomic<void (*)()> g_before_run{nullptr};  // set_device_wait_hooks
std::atomic<uint64_t (*)(uint64_t)> g_wait_limit{nullptr};

void before_run() {
  if (auto hook = g_before_run.load()) {
    hook();
  }
}

struct Executor {
  std::mutex lock;
  std::condition_variable posted;  // the thread waits on it for jobs
  std::condition_variable ran;  // issuers wait on it for jobs to end
  // Note [Waiters are woken when their job has run]: the tickets host threads wait past, under
  // `lock`; the executor wakes them only once the first of them has run.
  std::multiset<uint64_t> waiting;
  std::deque<Job> jobs;
  // Jobs posted. Written under `lock`; atomic for the executor's spin, which reads it without.
  std::atomic<uint64_t> issued{0};
  // Jobs run; the jobs run in order, so job k is done when done > k. Written under `lock`;
  // atomic for the host's look at the queue's depth (wait_for_room_on_device), made without.
  std::atomic<uint64_t> done{0};
  // Time host threads spent waiting for jobs since the executor last looked (Note [The device's
  // team sleeps between regions]).
  std::atomic<int64_t> host_waited_ns{0};
  bool started = false;
  // The first error of a job no host waited for, until a sync raises it.
  std::exception_ptr error;

  uint64_t post(Job job) {
    std::unique_lock<std::mutex> guard(lock);
    if (!started) {
      started = true;
      // Detached: it waits on `posted` for the process's life, and must not be joined at exit.
      std::thread([this] { loop(); }).detach();
    }
    jobs.push_back(std::move(job));
    const uint64_t ticket = issued.fetch_add(1, std::memory_order_release);
    posted.notify_all();
    return ticket;
  }

  void loop() {
    t_on_executor = true;
    mark_device_thread();
    // Named as autograd names its threads (pt_autograd_N): in top -H, py-spy and perf, the
    // device's kernels show as this thread's, and its OpenMP workers, which take the name of
    // the thread that made them, as its team's.
    pthread_setname_np(pthread_self(), "neuron_device");
    bool team = false;  // this thread may hold an OpenMP team
    bool sleeping = false;  // an idle team is held: workers sleep between regions
    // The last window's verdict, kept while the team is let go: a host that waits for the
    // device (a sync per big op) and stalls past kIdleBeforeRelease would otherwise get a
    // held team with each re-made one, for a window at a time.
    bool host_waits = false;
    auto window = std::chrono::steady_clock::now();
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> guard(lock);
        if (jobs.empty()) {  // Note [The executor spins before it sleeps]
          spin_for_change(guard, issued, issued.load(std::memory_order_relaxed));
        }
        if (jobs.empty() && team && omp_pause() != nullptr &&
            !posted.wait_for(guard, kIdleBeforeRelease, [this] { return !jobs.empty(); })) {
          guard.unlock();
          release_team();  // frees this thread's team (none is active: no region is open)
          if (sleeping) {
            g_sleeping->hold(false);
            sleeping = false;
          }
          team = false;
          continue;
        }
        posted.wait(guard, [this] { return !jobs.empty(); });
        job = std::move(jobs.front());
        jobs.pop_front();
      }
      // Note [The stream's intra-op threads]: set only when it differs: at::set_num_threads
      // also calls mkl_set_dynamic(false) for the whole process, after which MKL's VML ran a
      // 2,048-element tanh on a thread team: 3-10x slower kernels for the rest of the process.
      if (at::get_num_threads() != job.threads) {
        at::set_num_threads(job.threads);
      }
      if (!team) {  // a team is made for this job: a window starts with it
        if (!sleeping && !host_waits && SleepingTeams::needed(job.threads)) {
          g_sleeping->hold(true);  // Note [The device's team sleeps between regions]
          sleeping = true;
        }
        window = std::chrono::steady_clock::now();
        host_waited_ns.store(0, std::memory_order_relaxed);
      }
      team = true;
      job.run();
      job.run = nullptr;  // what it captured goes now, on this thread
      if (const auto now = std::chrono::steady_clock::now(); now - window >= kWindow) {
        const double waited = 1e-9 * static_cast<double>(host_waited_ns.exchange(0, std::memory_order_relaxed)) /
                              std::chrono::duration<double>(now - window).count();
        host_waits = sleeping ? waited > kWaitedSpins : waited >= kWaitedSleeps;
        const bool sleep = SleepingTeams::needed(job.threads) && !host_waits;
        if (sleep != sleeping) {  // Note [The device's team sleeps between regions]
          sleeping = sleep;
          g_sleeping->hold(sleep);
        }
        window = now;
      }
      bool wake = false;
      {
        std::unique_lock<std::mutex> guard(lock);
        const uint64_t now_done = done.fetch_add(1, std::memory_order_release) + 1;
        wake = !waiting.empty() && now_done > *waiting.begin();  // Note [Waiters are woken when their job has run]
      }
      if (wake) {
        ran.notify_all();
      }
    }
  }

  // Waits, without the GIL (a job may free a Python-owned storage, or run a Python kernel,
  // which takes it), until done > ticket.
  //
  // Note [Waiters are woken when their job has run]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // The executor used to notify `ran` after every job, and a condition variable's waiter is
  // woken by each notify, to find its job not yet run and sleep again: a host waiting for room
  // in a full queue (8,192 jobs) or for a sync was woken once per job the device ran. In eager
  // mode's width-64 MLP step (device-bound: the host fills the queue and waits) the user's
  // thread blocked ~14 times a step, each wake a system call on the device's thread and a
  // context switch on the host's, whose cores the device's kernels share. Each waiter's ticket
  // is kept (a multiset: the user's thread, autograd's, a DataLoader's may wait at once), and
  // the executor notifies only when it has run the first of them; a waiter woken for another's
  // ticket waits again, as before.
  void wait_past(uint64_t ticket) {
    const auto start = std::chrono::steady_clock::now();
    without_python([&] {
      std::unique_lock<std::mutex> guard(lock);
      if (done > ticket) {
        return;
      }
      const auto mine = waiting.insert(ticket);
      ran.wait(guard, [&] { return done > ticket; });
      waiting.erase(mine);
    });
    host_waited_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count(),
                             std::memory_order_relaxed);
  }
};

// Never destroyed: at exit its thread still waits on `posted`, and destroying a condition
// variable that a thread waits on blocks exit for ever (glibc's pthread_cond_destroy).
Executor* g_executor = new Executor;

// A forked child has no executor thread (the parent emptied the queue before forking:
// dispatch/registration.py), and its copy of the lock may be mid-use: it starts a fresh
// executor, whose thread starts at its first job. The old one is leaked.
const int g_fork_handler = pthread_atfork(
    settle_released_teams, [] { g_release.unlock(); },
    [] {
      g_release.unlock();  // the child's one thread is the one that locked it
      g_executor = new Executor;
      g_sleeping = new SleepingTeams;  // its thread is the parent's
    });

}  // namespace

bool on_device_thread() { return t_on_executor; }

void set_device_wait_hooks(void (*before)(), uint64_t (*wait_limit)(uint64_t last)) {
  g_before_run.store(before);
  g_wait_limit.store(wait_limit);
}

void without_python(const std::function<void()>& fn) {
  if (Py_IsInitialized() && PyGILState_Check()) {
    PyThreadState* saved = PyEval_SaveThread();
    try {
      fn();
    } catch (...) {
      PyEval_RestoreThread(saved);
      throw;
    }
    PyEval_RestoreThread(saved);
  } else {
    fn();
  }
}

uint64_t post_to_device(std::function<void()> job) {
  take_host_thread_count();  // Note [Kernels take the host's thread count] (threads.cpp)
  const int threads = host_thread_count();
  return g_executor->post(Job{[run = std::move(job)] {
                         try {
                           run();
                         } catch (...) {
                           note_device_error(std::current_exception());
                         }
                       },
                       threads});
}

void run_on_device(const std::function<void()>& job) {
  if (t_on_executor) {
    job();
    return;
  }
  before_run();
  std::exception_ptr error;
  // The issuing thread's state (grad mode, profiler callbacks, dispatch keys), as autograd's
  // threads take the caller's: a profiler records the kernel's ranges, on the device's thread.
  at::ThreadLocalState state;
  // Who issued it, for the device timeline (Note [The device timeline]): captured here, on
  // the issuing thread, where kineto's correlation id and the user's frame are.
  std::optional<TimelineIssue> issue;
  if (timeline_recording()) {
    issue = timeline_issue();
  }
  take_host_thread_count();
  const uint64_t ticket = g_executor->post(Job{[&] {
                                                 try {
                                                   const at::ThreadLocalStateGuard guard(state);
                                                   const TimelineIssueScope issued(issue ? &*issue : nullptr);
                                                   job();
                                                 } catch (...) {
                                                   error = std::current_exception();
                                                 }
                                               },
                                               host_thread_count()});
  g_executor->wait_past(ticket);
  if (error) {
    std::rethrow_exception(error);
  }
}

void note_device_error(std::exception_ptr error) {
  std::unique_lock<std::mutex> guard(g_executor->lock);
  if (!g_executor->error) {
    g_executor->error = std::move(error);
  }
}

void wait_for_device() {
  if (t_on_executor) {
    return;  // a job's own host access: everything before it has run
  }
  uint64_t last = 0;
  {
    std::unique_lock<std::mutex> guard(g_executor->lock);
    if (g_executor->issued == 0) {
      return;
    }
    last = g_executor->issued - 1;
  }
  if (auto limit = g_wait_limit.load()) {
    last = limit(last);  // UINT64_MAX: nothing to wait for
  }
  if (last != UINT64_MAX) {
    g_executor->wait_past(last);
  }
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> guard(g_executor->lock);
    std::swap(error, g_executor->error);
  }
  if (error) {
    std::rethrow_exception(error);  // once: a later sync raises only a later error
  }
}

bool device_idle() {
  if (!t_on_executor) {
    before_run();  // a query submits what is open, as a real device's does
  }
  std::unique_lock<std::mutex> guard(g_executor->lock);
  return g_executor->done.load() == g_executor->issued.load();
}

// Note [The device's queue is bounded]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A host that issues faster than the device runs would queue without end: CUDA's launch
// queue holds about a thousand launches, and a launch past it waits in the launch call for
// room. So does ours. Unbounded, a training loop with no sync ran ever further ahead of the
// device, holding every queued op's arguments and bookkeeping in host memory (eager mode, a
// 256-wide MLP: after 3,000 steps the host's table of queued reads held 41,000 entries, and
// looking up in it was a fifth of the host thread's samples). The wait is the host's wait
// for the device (without the GIL), as a sync's: the team's spin follows it (Note [The
// device's team sleeps between regions]). A full queue is waited on until half of it has run.
// Eight times CUDA's: our kernels share the host's cores, and a host that has issued its last
// op lets the device's team have them all (a 256-wide MLP, 200 eager steps with no sync: a
// third slower with 1,024, the host and the team sharing the cores to the end).
constexpr uint64_t kQueuedJobs = 8192;

void wait_for_room_on_device() {
  if (t_on_executor) {
    return;
  }
  const uint64_t issued = g_executor->issued.load(std::memory_order_acquire);
  if (issued - g_executor->done.load(std::memory_order_acquire) < kQueuedJobs) {
    return;
  }
  // Until half the queue has run, not one job: a wait per job, once full, would wake the host
  // for every op the device runs.
  uint64_t last = issued - kQueuedJobs / 2;
  if (auto limit = g_wait_limit.load()) {
    last = limit(last);  // a streamed launch still open is sealed first: it waits for its host
  }
  if (last != UINT64_MAX) {
    g_executor->wait_past(last);
  }
}

void sleep_on_device(double seconds) {
  post_to_device([seconds] { std::this_thread::sleep_for(std::chrono::duration<double>(seconds)); });
}

int64_t device_jobs_queued() {
  return static_cast<int64_t>(g_executor->issued.load() - g_executor->done.load());
}

void release_host_thread_team() {
  // A thread with no team, or inside a parallel region, is left as it is (cheap: libgomp
  // looks at one thread-local pointer).
  if (omp_pause() != nullptr && !t_on_executor) {
    release_team();
  }
}

}  // namespace neuron
