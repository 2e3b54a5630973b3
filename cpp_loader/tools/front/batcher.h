// Dynamic batching of one served model version's Predict calls, as the Python batcher does (serving/batcher.py).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "recship/model.h"

namespace recship::front {

class Call;
class Front;

// How one model version batches: the server's flags, or the model's own config.yaml (the "settings" of "load").
struct Batching {
  int64_t max_batch_size = rules::kMaxBatchSizeDefault;
  double max_delay_ms = rules::kMaxDelayMsDefault;  // 0 (greedy, the default): no waiting, but calls queued during a forward still run together
  bool batching = true;       // false: every call runs alone
  int64_t max_queue = rules::kMaxQueueDefault;
  int torch_threads = 0;      // intra-op threads per forward; 0: torch's default
};

// The one thread that runs the forwards of every batcher, one at a time in the order given (as serving/batcher.py's
// DeviceThread): a thread that runs forwards keeps what they cost after they end, its OpenMP team of intra-op
// threads and its malloc arena holding its largest batch's freed activations (glibc), so one per device, not one per
// served model.
class DeviceThread {
 public:
  DeviceThread() : thread_([this] { main(); }) {}
  ~DeviceThread();  // runs the forwards given, then ends the thread
  // Runs forward() on the device's thread with `threads` intra-op threads (0: as they are); returns once it ran,
  // throwing what it threw.
  void run(std::function<void()> forward, int threads);

 private:
  struct Job {
    std::function<void()> forward;
    int threads;
    std::promise<void> done;
  };
  void main();

  std::mutex mu_;
  std::condition_variable ready_;
  std::deque<Job> jobs_;
  bool stopping_ = false;
  std::thread thread_;  // last: started once the members above exist
};

// Queues Predict calls for one model version and runs them in merged batches (their forwards on the front's
// DeviceThread): the oldest call waits up to max_delay for company, a batch holds at most max_batch_size examples,
// calls whose client gave up or whose deadline passed are answered without running, a failing forward fails only
// its batch, and every call gets exactly its own rows.
class Batcher {
 public:
  enum class Submitted { kQueued, kFull, kStopped };
  Batcher(Front* front, std::shared_ptr<const recship::Model> model, std::string name, int64_t version, Batching settings);
  ~Batcher() {
    stop();
    if (thread_.joinable()) thread_.detach();  // only when the last reference went on the worker itself
  }
  Submitted submit(Call* call);
  void stop();  // runs what is queued, then ends the thread; later submits get kStopped
  // From now on a batch waits for no company (the front takes no more calls): what is queued runs at once.
  void close_window();
  int64_t pending() {  // calls waiting for a forward (the metrics' queue depth)
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(queue_.size()) + (carry_ != nullptr ? 1 : 0);
  }

  const std::string name;
  const int64_t version;
  const std::shared_ptr<const recship::Model> model;
  const Batching settings;

 private:
  void main();
  bool collect(std::vector<Call*>& batch);  // false once stopped and drained
  void run(const std::vector<Call*>& batch);

  Front* front_;
  std::mutex mu_;
  std::condition_variable ready_;
  std::deque<Call*> queue_;
  Call* carry_ = nullptr;  // the call that did not fit the last batch: it starts the next
  bool stopping_ = false;
  bool window_closed_ = false;
  std::thread thread_;
};

}  // namespace recship::front
