#include "front/front.h"

#include <grpcpp/grpcpp.h>
#include <malloc.h>

#include <set>
#include <thread>

#include "front/log.h"

namespace recship::front {

namespace {

grpc::ChannelArguments backend_args() {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  return args;
}

// Returns the heap's free memory to the OS (glibc; elsewhere nothing to do).
void release_memory() {
#ifdef __GLIBC__
  malloc_trim(0);
#endif
}

// Calls already queued on a replaced or unloaded version finish on it; then it goes (off the control thread).
void retire(std::shared_ptr<Batcher> old) {
  if (old) std::thread([old]() mutable { old->stop(); old.reset(); }).detach();
}

}  // namespace

Front::Front(Config c)
    : config(std::move(c)),
      stats(config.tables.latency_buckets, config.tables.batch_buckets),
      admission(config.max_inflight_bytes),
      stub(grpc::CreateCustomChannel(config.backend, grpc::InsecureChannelCredentials(), backend_args())) {}

std::shared_ptr<Batcher> Front::route(const std::string& name, int64_t version) {
  std::shared_lock<std::shared_mutex> lock(mu_);
  auto it = served_.find(name);
  if (it == served_.end() || (version != 0 && version != it->second->version)) return nullptr;
  return it->second;
}

std::string Front::load(const std::string& name, int64_t version, const std::string& path, const std::string& format,
                        const Batching& settings, const std::optional<std::string>& manifest_sha256) {
  recship::LoadOptions options;
  options.format = format;
  if (manifest_sha256) options.trusted = std::set<std::string>{*manifest_sha256};
  options.max_batch_size = settings.max_batch_size;
  // the version is freed when its last holder lets go: the batcher, once retired, and the calls it answered
  // (each holds the batcher until gRPC is done with it); then its heap goes back to the OS, as the Python
  // server's release_memory does (glibc keeps what a thread freed in that thread's arena otherwise)
  std::unique_ptr<recship::Model> loaded;
  try {
    loaded = recship::Model::load(path, options);
  } catch (...) {  // what the failed load allocated is freed: hand it back too
    release_memory();
    throw;
  }
  std::shared_ptr<const recship::Model> model(loaded.release(), [name, version](const recship::Model* m) {
    delete m;
    release_memory();
    log_line("INFO", "freed " + name + " version " + std::to_string(version));
  });
  auto batcher = std::make_shared<Batcher>(this, model, name, version, settings);
  std::shared_ptr<Batcher> old;
  {
    std::unique_lock<std::shared_mutex> lock(mu_);
    old = served_[name];
    served_[name] = batcher;
  }
  retire(std::move(old));
  log_line("INFO", "serving " + name + " version " + std::to_string(version) + " from " + path + " (" + model->format() + ")");
  return model->format();
}

void Front::unload(const std::string& name) {
  std::shared_ptr<Batcher> old;
  {
    std::unique_lock<std::shared_mutex> lock(mu_);
    auto it = served_.find(name);
    if (it == served_.end()) return;
    old = it->second;
    served_.erase(it);
  }
  retire(std::move(old));
}

void Front::unload_all() {
  std::map<std::string, std::shared_ptr<Batcher>> all;
  {
    std::unique_lock<std::shared_mutex> lock(mu_);
    all.swap(served_);
  }
  for (auto& [name, b] : all) b->stop();
}

void Front::close_windows() {
  std::shared_lock<std::shared_mutex> lock(mu_);
  for (const auto& [name, b] : served_) b->close_window();
}

json Front::gauges() {
  json pending = json::array();
  std::shared_lock<std::shared_mutex> lock(mu_);
  for (const auto& [name, b] : served_) pending.push_back({{"model", name}, {"version", b->version}, {"pending", b->pending()}});
  return {{"pending", pending}, {"inflight_bytes", admission.inflight()}};
}

}  // namespace recship::front
