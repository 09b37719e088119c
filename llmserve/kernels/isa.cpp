// Which ISA variant of the kernels this process runs (isa_avx2.cpp, isa_avx512.cpp, or the
// portable loops): the widest the CPU has until select_cpu_isa() says otherwise. llmserve.plan
// decides it once at start-up; a CPU without the named ISA is refused, never run.

#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <iterator>
#include <string>

#include "gemv.h"

namespace {

const char* const kIsaNames[] = {"portable", "avx2", "avx512"};

bool cpu_has(int isa) {
  __builtin_cpu_init();
  switch (isa) {
    case llmserve::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    case llmserve::kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    default: return true;
  }
}

int best_isa() { return cpu_has(llmserve::kAvx512) ? llmserve::kAvx512 : cpu_has(llmserve::kAvx2) ? llmserve::kAvx2 : llmserve::kPortable; }

std::atomic<int> selected_isa{-1};  // -1: the best this CPU has

void select_cpu_isa(const std::string& name) {
  const auto it = std::find(std::begin(kIsaNames), std::end(kIsaNames), name);
  TORCH_CHECK(it != std::end(kIsaNames), "select_cpu_isa: unknown ISA '", name, "' (portable, avx2 or avx512)");
  const int isa = static_cast<int>(it - std::begin(kIsaNames));
  TORCH_CHECK(cpu_has(isa), "select_cpu_isa: this CPU lacks ", name);
  selected_isa.store(isa);
}

std::string cpu_isa() { return kIsaNames[llmserve::current_isa()]; }

}  // namespace

namespace llmserve {

int current_isa() {
  const int isa = selected_isa.load(std::memory_order_relaxed);
  return isa >= 0 ? isa : best_isa();
}

}  // namespace llmserve

TORCH_LIBRARY_FRAGMENT(llmserve, m) {
  m.def("select_cpu_isa(str isa) -> ()");
  m.def("cpu_isa() -> str");
}

TORCH_LIBRARY_IMPL(llmserve, CatchAll, m) {
  m.impl("select_cpu_isa", &select_cpu_isa);
  m.impl("cpu_isa", &cpu_isa);
}
