// How many OpenMP threads a kernel runs on: the caller's count, less the cores other processes
// keep busy. A team thread that must share its core with another process stalls the whole team at
// every barrier (a 2-thread decode step on this library's 2-core host ran at half the speed of
// 1 thread while another process kept one core busy), so a kernel gives such cores up.
//
// The busy cores are measured, at most every kSampleEveryNs, from /proc/stat: the ticks the cores
// this process may run on (its affinity mask) spent busy, less the CPU time this process itself
// used, over the ticks elapsed. Between samples a call costs one coarse clock read and an atomic
// load. Where /proc/stat cannot be read, or with DUALOP_CPU_ADAPTIVE_THREADS=0, the caller's
// count stands.
#include <sched.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

constexpr int64_t kSampleEveryNs = 100'000'000;

int64_t now_ns(clockid_t clock) {
  timespec ts;
  clock_gettime(clock, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

// One reading of the counters: busy and total ticks summed over the cores in the affinity mask,
// and this process's CPU time.
struct Usage {
  int64_t busy_ticks = 0, total_ticks = 0, self_ns = 0;
  int cores = 0;
};

bool read_usage(Usage& u) {
  cpu_set_t mask;
  CPU_ZERO(&mask);
  if (sched_getaffinity(0, sizeof(mask), &mask) != 0) return false;
  FILE* f = std::fopen("/proc/stat", "re");
  if (f == nullptr) return false;
  u = Usage{};
  char line[512];
  while (std::fgets(line, sizeof line, f) != nullptr && std::strncmp(line, "cpu", 3) == 0) {
    if (line[3] < '0' || line[3] > '9') continue;  // the line summing every core
    char* p = nullptr;
    const long cpu = std::strtol(line + 3, &p, 10);
    if (cpu < 0 || cpu >= CPU_SETSIZE || !CPU_ISSET(cpu, &mask)) continue;
    // user nice system idle iowait irq softirq steal: all but idle and iowait are busy
    int64_t ticks[8] = {};
    for (int64_t& t : ticks) t = std::strtoll(p, &p, 10);
    for (int i = 0; i < 8; ++i) {
      u.total_ticks += ticks[i];
      if (i != 3 && i != 4) u.busy_ticks += ticks[i];
    }
    ++u.cores;
  }
  std::fclose(f);
  u.self_ns = now_ns(CLOCK_PROCESS_CPUTIME_ID);
  return u.cores > 0;
}

bool adaptive() {
  static const bool on = [] {
    const char* v = std::getenv("DUALOP_CPU_ADAPTIVE_THREADS");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return on;
}

std::atomic<int> g_free_cores{0};  // 0 until two readings have been compared
std::atomic<int64_t> g_next_sample_ns{0};
std::atomic<bool> g_sampling{false};
Usage g_last;  // written only by the thread that holds g_sampling
bool g_have_last = false;

void sample(int64_t now) {
  Usage u;
  if (!read_usage(u)) {
    g_next_sample_ns.store(INT64_MAX, std::memory_order_relaxed);  // never again: the count stands
    return;
  }
  g_next_sample_ns.store(now + kSampleEveryNs, std::memory_order_relaxed);
  if (g_have_last && u.cores == g_last.cores && u.total_ticks > g_last.total_ticks) {
    const double ticks_per_core = double(u.total_ticks - g_last.total_ticks) / u.cores;
    const double self_ticks = double(u.self_ns - g_last.self_ns) * 1e-9 * double(sysconf(_SC_CLK_TCK));
    const double others = (double(u.busy_ticks - g_last.busy_ticks) - self_ticks) / ticks_per_core;
    g_free_cores.store(dualop_team_for_usage(u.cores, u.cores, others), std::memory_order_relaxed);
  } else if (g_have_last && u.total_ticks <= g_last.total_ticks) {
    return;  // no tick elapsed yet: keep the older reading, so the next window is longer
  }
  g_last = u;
  g_have_last = true;
}

}  // namespace

extern "C" int dualop_team_for_usage(int requested, int cores, double others_busy_cores) {
  if (requested <= 1) return 1;
  const double others = std::isfinite(others_busy_cores) ? std::max(others_busy_cores, 0.0) : 0.0;
  // a core counts as taken once another process keeps it busy more than half the time
  const int free_cores = static_cast<int>(std::floor(double(cores) - others + 0.5));
  return std::clamp(free_cores, 1, requested);
}

extern "C" int dualop_team_size(int requested) {
  if (requested <= 1) return 1;
  if (!adaptive()) return requested;
  const int64_t now = now_ns(CLOCK_MONOTONIC_COARSE);
  if (now >= g_next_sample_ns.load(std::memory_order_relaxed) &&
      !g_sampling.exchange(true, std::memory_order_acquire)) {
    if (now >= g_next_sample_ns.load(std::memory_order_relaxed)) sample(now);
    g_sampling.store(false, std::memory_order_release);
  }
  const int free_cores = g_free_cores.load(std::memory_order_relaxed);
  return free_cores <= 0 ? requested : std::min(requested, free_cores);
}
