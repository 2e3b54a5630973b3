// Admission of request bytes in flight: the Python server's --max-inflight-mb, counted apart from its own.
#pragma once

#include <atomic>
#include <cstdint>

namespace recship::front {

class Admission {
 public:
  explicit Admission(int64_t limit) : limit(limit) {}

  // Holds n bytes if the total stays within the limit; *total: the bytes that would be in flight with them.
  bool admit(int64_t n, int64_t* total) {
    const int64_t now = inflight_.fetch_add(n) + n;
    *total = now;
    if (now <= limit) return true;
    inflight_.fetch_sub(n);
    return false;
  }
  void release(int64_t n) { inflight_.fetch_sub(n); }
  int64_t inflight() const { return inflight_.load(); }

  const int64_t limit;

 private:
  std::atomic<int64_t> inflight_{0};
};

}  // namespace recship::front
