#include "cpu/parallel.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "environment.h"

namespace mlxq::cpu {

namespace {

class Pool {
 public:
  explicit Pool(int n_threads) : n_threads_(n_threads) {
    for (int w = 1; w < n_threads_; ++w) {
      workers_.emplace_back([this, w] { worker_loop(w); });
    }
  }

  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) {
      t.join();
    }
  }

  int size() const {
    return n_threads_;
  }

  void run(int n_tasks, const std::function<void(int, int)>& fn) {
    // One job at a time: MLX may evaluate on several CPU streams at once.
    std::lock_guard<std::mutex> job_lock(job_mutex_);
    if (n_threads_ == 1 || n_tasks <= 1) {
      for (int t = 0; t < n_tasks; ++t) {
        fn(t, 0);
      }
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      fn_ = &fn;
      n_tasks_ = n_tasks;
      next_.store(0);
      error_ = nullptr;
      active_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    wake_.notify_all();
    drain(0);
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return active_ == 0; });
    fn_ = nullptr;
    if (error_) {
      std::rethrow_exception(error_);
    }
  }

 private:
  void drain(int worker) {
    for (int t = next_.fetch_add(1); t < n_tasks_; t = next_.fetch_add(1)) {
      try {
        (*fn_)(t, worker);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) {
          error_ = std::current_exception();
        }
      }
    }
  }

  void worker_loop(int worker) {
    long seen = 0;
    while (true) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) {
          return;
        }
        seen = generation_;
      }
      drain(worker);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (--active_ == 0) {
          done_.notify_one();
        }
      }
    }
  }

  const int n_threads_;
  std::vector<std::thread> workers_;
  std::mutex job_mutex_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  const std::function<void(int, int)>* fn_ = nullptr;
  int n_tasks_ = 0;
  std::atomic<int> next_{0};
  std::exception_ptr error_;
  int active_ = 0;
  long generation_ = 0;
  bool stop_ = false;
};

int configured_threads() {
  if (const int n = environment().num_threads; n > 0) {
    return n;
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

Pool& pool() {
  // Leaked on purpose: joining threads during static destruction at
  // interpreter exit can deadlock.
  static Pool* p = new Pool(configured_threads());
  return *p;
}

} // namespace

int num_threads() {
  return pool().size();
}

void parallel_for(int n_tasks, const std::function<void(int, int)>& fn) {
  pool().run(n_tasks, fn);
}

} // namespace mlxq::cpu
