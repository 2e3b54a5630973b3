#include "front/batcher.h"

#include "front/call.h"
#include "front/front.h"
#include "front/log.h"

namespace recship::front {

DeviceThread::~DeviceThread() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  ready_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void DeviceThread::run(std::function<void()> forward, int threads) {
  std::future<void> done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(Job{std::move(forward), threads, {}});
    done = jobs_.back().done.get_future();
  }
  ready_.notify_one();
  done.get();
}

void DeviceThread::main() {
  int threads = 0;  // what this thread's intra-op threads were last set to
  while (true) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      ready_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping, and every forward given has run
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    if (job.threads > 0 && job.threads != threads) {
      recship::set_intra_op_threads(job.threads);
      threads = job.threads;
    }
    try {
      job.forward();
      job.done.set_value();
    } catch (...) {  // the caller's to handle
      job.done.set_exception(std::current_exception());
    }
  }
}

Batcher::Batcher(Front* front, std::shared_ptr<const recship::Model> m, std::string n, int64_t v, Batching s)
    : name(std::move(n)), version(v), model(std::move(m)), settings(s), front_(front) {
  thread_ = std::thread([this] { main(); });
}

Batcher::Submitted Batcher::submit(Call* call) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return Submitted::kStopped;
    if (static_cast<int64_t>(queue_.size()) >= settings.max_queue) return Submitted::kFull;
    queue_.push_back(call);
  }
  ready_.notify_one();
  return Submitted::kQueued;
}

void Batcher::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  ready_.notify_all();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

void Batcher::close_window() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    window_closed_ = true;
  }
  ready_.notify_all();
}

void Batcher::main() {
  std::vector<Call*> batch;
  while (collect(batch)) {
    if (!batch.empty()) run(batch);
    batch.clear();
  }
}

bool Batcher::collect(std::vector<Call*>& batch) {
  std::unique_lock<std::mutex> lock(mu_);
  Call* first = carry_;
  carry_ = nullptr;
  if (first == nullptr) {
    ready_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return false;  // stopping, and everything queued has run
    first = queue_.front();
    queue_.pop_front();
  }
  batch.push_back(first);
  int64_t examples = first->prepared().batch_size;
  if (!settings.batching) return true;  // one call per forward, whatever is queued
  const auto until = first->enqueued() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double, std::milli>(settings.max_delay_ms));
  while (examples < settings.max_batch_size) {
    if (queue_.empty() && (settings.max_delay_ms <= 0 || window_closed_ ||  // no waiting: only what is queued already
                           !ready_.wait_until(lock, until, [this] { return stopping_ || window_closed_ || !queue_.empty(); })))
      break;
    if (queue_.empty()) break;  // stopping, or the window closed: run what we have
    Call* next = queue_.front();
    if (next->cancelled()) {  // its client gave up: it takes no room (run() answers it)
      queue_.pop_front();
      batch.push_back(next);
      continue;
    }
    if (examples + next->prepared().batch_size > settings.max_batch_size) {
      queue_.pop_front();
      carry_ = next;  // it starts the next batch
      break;
    }
    queue_.pop_front();
    batch.push_back(next);
    examples += next->prepared().batch_size;
  }
  return true;
}

void Batcher::run(const std::vector<Call*>& batch) {
  const Tables& tables = front_->config.tables;
  std::vector<Call*> live;
  std::vector<const recship::Prepared*> inputs;
  for (Call* call : batch) {
    if (call->cancelled()) call->refuse(tables.cancelled);
    else if (call->expired()) call->refuse(tables.deadline);
    else {
      live.push_back(call);
      inputs.push_back(&call->prepared());
    }
  }
  if (live.empty()) return;
  const auto started = Clock::now();
  std::vector<recship::NamedOutputs> outputs;
  try {
    front_->device.run([&] { outputs = model->predict_batch(inputs); }, settings.torch_threads);
  } catch (const std::exception& e) {  // the model failed: this batch's calls get the error, the worker goes on
    sampled_log().log("forward failed", "ERROR", "forward failed for a batch of " + std::to_string(live.size()) + " requests: " + e.what());
    for (Call* call : live) call->refuse(tables.internal, {{"type", "Error"}, {"error", e.what()}});
    return;
  }
  const double compute = std::chrono::duration<double>(Clock::now() - started).count();
  std::vector<double> waits;
  int64_t examples = 0, ids = 0;
  for (Call* call : live) {
    waits.push_back(std::chrono::duration<double>(started - call->enqueued()).count());
    examples += call->prepared().batch_size;
    ids += static_cast<int64_t>(call->prepared().ids.size());
  }
  front_->stats.batch(name, std::to_string(version), examples, waits, compute, ids);
  for (size_t i = 0; i < live.size(); ++i) live[i]->answer(outputs[i], name, version);
}

}  // namespace recship::front
