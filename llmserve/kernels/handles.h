// A process-wide table of registered weights keyed by an int handle: the layers of a model
// register theirs once (from Python) and pass the handle to the op on each call, so a compiled
// graph holds an int where it would otherwise take the weight's tensors as inputs.

#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace llmserve {

template <typename T>
class HandleTable {
 public:
  void put(int64_t handle, T value) {
    std::lock_guard<std::mutex> lock(mutex_);
    table_[handle] = std::move(value);
  }

  void erase(int64_t handle) {
    std::lock_guard<std::mutex> lock(mutex_);
    table_.erase(handle);
  }

  // a copy of the entry (it holds tensors: the caller keeps them alive while it runs)
  T get(int64_t handle, const char* op) const {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = table_.find(handle);
    TORCH_CHECK(it != table_.end(), op, ": no weight is registered under handle ", handle);
    return it->second;
  }

 private:
  mutable std::mutex mutex_;
  std::unordered_map<int64_t, T> table_;
};

}  // namespace llmserve
