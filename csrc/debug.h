// Test hooks. With output poisoning on, every primitive fills a freshly
// allocated output with a sentinel (NaN for floats, 0xFF bytes otherwise)
// before its kernel runs, so elements a kernel forgets to write fail tests
// instead of silently keeping whatever the allocator's cache held.
#pragma once

#include "mlx/array.h"

namespace mlxq {

void set_poison_outputs(bool enabled);
bool poison_outputs();
void poison_if_enabled(mlx::core::array& out);

// Prints a native backtrace to stderr on SIGSEGV/SIGABRT (for machines with
// no debugger), then lets the signal kill the process as before.
void install_crash_backtrace();

} // namespace mlxq
