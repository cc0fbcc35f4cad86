// The task runner of the CPU kernels: a call's work split into tasks, run on XLA's intra-op pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"

// Tasks are claimed from a shared counter by the calling thread and by helpers scheduled on XLA's
// intra-op pool. The caller waits only for tasks already claimed (they run on live threads), so
// the call finishes even when no helper ever starts; a helper that starts late finds no task and
// touches nothing but the state it co-owns. Each thread that claims a task takes a slot number
// (0, 1, ...) for per-thread state, such as partial sums.
struct Tasks {
  int64_t tasks = 0;
  std::atomic<int64_t> next{0}, done{0}, joined{0};
};

template <typename W>  // W: Tasks with run(task, slot)
void drain(W& work) {
  int64_t slot = -1;
  for (int64_t t; (t = work.next.fetch_add(1)) < work.tasks;) {
    if (slot < 0) slot = work.joined.fetch_add(1);
    work.run(t, slot);
    work.done.fetch_add(1, std::memory_order_release);
  }
}

template <typename W>
void run_tasks(xla::ffi::ThreadPool& pool, const std::shared_ptr<W>& work) {
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  for (int64_t i = 1; i < std::min(threads, work->tasks); ++i)
    pool.Schedule([work] { drain(*work); });
  drain(*work);
  while (work->done.load(std::memory_order_acquire) < work->tasks) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
}
