// What every file of the native operators needs (kernels/native.py compiles them into one extension): the headers,
// ATen's vector type, the input checks and the thread-splitting helpers, which split over at::parallel_for's threads
// or over the step's team (below). The helpers sit in an anonymous namespace, so each file that includes this one
// gets its own copy with internal linkage, as when all the operators were one file.

#pragma once

// ==== headers ====

// ATen, not torch/extension.h: the operators need tensors and no Python, and pybind11 with the C++ frontend would
// near triple each file's compile time. bindings.cpp, which registers them, includes torch/extension.h.
#include <ATen/ATen.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#if defined(_OPENMP)
#include <omp.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>

// ==== the step's team ====

// StepProgram::run (native_step.cpp) runs a decode step's blocks in one OpenMP parallel region instead of opening
// one per operator (some five a block, each ending in a wait for the slowest thread): every thread of the region,
// the team, calls each operator with the same arguments, and the operator shares its work out over the team where
// it would have shared it over at::parallel_for's threads, all waiting for each other where at::parallel_for would
// have returned (the helpers below). The same code runs in both ways, so the results are the same bits.
namespace llmeasyquant::team {

// Two task counters the team shares (for_workers takes them in turn).
struct Team {
  std::atomic<int64_t> counters[2] = {0, 0};
};

// A thread's place in its team; `loops` counts the for_workers calls it has made (every thread makes the same ones).
struct Member {
  Team* team;
  int64_t index, threads;
  int64_t loops = 0;
};

// The calling thread's place, null outside a team. An inline variable of a named namespace: one object across the
// extension's files, where the anonymous namespace below gives each file its own copy of the helpers.
inline thread_local Member* current = nullptr;

}  // namespace llmeasyquant::team

namespace {

// ==== vector type ====

using Vec = at::vec::Vectorized<float>;

// ==== input checks ====

// Tensors written in place must already be contiguous; inputs are made so (no copy when they are).
void check_cpu(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", c10::toString(dtype), ", got ",
              c10::toString(t.scalar_type()));
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

at::Tensor input(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  at::Tensor dense = t.contiguous();
  check_cpu(dense, dtype, name);
  return dense;
}

// ==== thread splitting ====

using llmeasyquant::team::Member;

// The threads work is split over: the team's, or at::parallel_for's.
inline int64_t split_threads() {
  const Member* member = llmeasyquant::team::current;
  return member != nullptr ? member->threads : at::get_num_threads();
}

// Waits for the rest of the team; nothing outside one.
inline void team_barrier() {
  if (llmeasyquant::team::current != nullptr) {
#pragma omp barrier
  }
}

// body(first, last) over [begin, end) in chunks of at least `grain`, as at::parallel_for splits it: over its threads,
// or over the team where the calling thread is in one (each thread its own chunk, then all wait for the others, as
// at::parallel_for returns once every chunk is done). A range of at most `grain` runs on one thread.
template <typename Body>
void parallel_range(int64_t begin, int64_t end, int64_t grain, const Body& body) {
  const Member* member = llmeasyquant::team::current;
  if (member == nullptr) {
    at::parallel_for(begin, end, grain, body);
    return;
  }
  if (end > begin) {
    const int64_t chunks = std::min(member->threads, (end - begin + std::max<int64_t>(1, grain) - 1) /
                                                         std::max<int64_t>(1, grain));
    const int64_t size = (end - begin + chunks - 1) / chunks, first = begin + member->index * size;
    if (first < end) body(first, std::min(end, first + size));
  }
  team_barrier();
}

// body(worker, next) for each worker 0..workers-1, the workers spread over the threads (at::parallel_for's, or the
// team's); next() hands out 0, 1, 2, ... from one counter they all share, so that tasks go to whichever thread is
// free. Returns once every worker is done.
template <typename Body>
void for_workers(int64_t workers, const Body& body) {
  Member* member = llmeasyquant::team::current;
  if (member == nullptr) {
    std::atomic<int64_t> counter{0};
    const auto next = [&counter] { return counter.fetch_add(1, std::memory_order_relaxed); };
    at::parallel_for(0, workers, 1, [&](int64_t first, int64_t last) {
      for (int64_t w = first; w < last; ++w) body(w, next);
    });
    return;
  }
  // Consecutive loops take the two counters in turn: the other one is the next loop's, which no thread touches
  // before the barrier that ends this loop (and publishes its reset); the barrier that ended the last loop saw every
  // thread done with it.
  std::atomic<int64_t>* counters = member->team->counters;
  std::atomic<int64_t>& counter = counters[member->loops % 2];
  if (member->index == 0) counters[(member->loops + 1) % 2].store(0, std::memory_order_relaxed);
  ++member->loops;
  const auto next = [&counter] { return counter.fetch_add(1, std::memory_order_relaxed); };
  for (int64_t w = member->index; w < workers; w += member->threads) body(w, next);
  team_barrier();
}

// body() with the calling thread out of its team: what body splits runs on this thread alone. For something small
// each thread of a team makes its own copy of, rather than waiting for one thread to make it.
template <typename Body>
void on_own(const Body& body) {
  Member* member = llmeasyquant::team::current;
  llmeasyquant::team::current = nullptr;
  body();
  llmeasyquant::team::current = member;
}

// Runs body(first, last) over row ranges, split over the threads where the rows hold enough values to pay for it
// (a prompt's rows); a decode step's single row runs on one thread.
template <typename Body>
void for_rows(int64_t rows, int64_t width, const Body& body) {
  constexpr int64_t kValuesPerTask = 16384;
  parallel_range(0, rows, std::max<int64_t>(1, kValuesPerTask / std::max<int64_t>(1, width)), body);
}

}  // namespace
