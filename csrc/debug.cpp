#include "debug.h"

#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <limits>

#include "mlx/types/half_types.h"

namespace mlxq {

namespace mx = mlx::core;

namespace {
std::atomic<bool> g_poison{false};
std::atomic<const char*> g_last_sdpa_kernel{""};

template <typename T>
void fill(mx::array& out, T value) {
  T* p = out.data<T>();
  for (size_t i = 0; i < out.data_size(); ++i) {
    p[i] = value;
  }
}
} // namespace

void set_poison_outputs(bool enabled) {
  g_poison.store(enabled);
}

bool poison_outputs() {
  return g_poison.load();
}

void note_sdpa_kernel(const char* name) {
  g_last_sdpa_kernel.store(name);
}

const char* take_last_sdpa_kernel() {
  return g_last_sdpa_kernel.exchange("");
}

void poison_if_enabled(mx::array& out) {
  if (!g_poison.load()) {
    return;
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  switch (out.dtype()) {
    case mx::float32: fill<float>(out, nan); break;
    case mx::float16: fill<mx::float16_t>(out, mx::float16_t(nan)); break;
    case mx::bfloat16: fill<mx::bfloat16_t>(out, mx::bfloat16_t(nan)); break;
    default: std::memset(out.data<void>(), 0xFF, out.nbytes()); break;
  }
}

namespace {
void print_backtrace(int sig) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
  signal(sig, SIG_DFL);
  raise(sig);
}
} // namespace

void install_crash_backtrace() {
  signal(SIGSEGV, print_backtrace);
  signal(SIGABRT, print_backtrace);
}

} // namespace mlxq
