// A small persistent worker pool for the CPU kernels. MLX runs each CPU stream
// on one thread; a kernel that wants every core fans its tasks out here and
// waits. Tasks are claimed from an atomic counter, so uneven tasks (causal
// tiles) balance themselves.
#pragma once

#include <functional>

namespace mlxq::cpu {

// Number of threads a parallel_for uses (the caller included). Defaults to the
// hardware concurrency; the environment variable MLXQ_NUM_THREADS overrides it.
int num_threads();

// Runs fn(task, worker) for task in [0, n_tasks) on up to num_threads()
// threads; worker is in [0, num_threads()) and identifies per-thread scratch.
// Returns when every task has finished; rethrows the first exception.
void parallel_for(int n_tasks, const std::function<void(int, int)>& fn);

} // namespace mlxq::cpu
