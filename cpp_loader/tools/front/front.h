// The front's state: its configuration, the model versions it serves (one batcher each), the request bytes in
// flight, its counts, and the channel to the Python server every call it does not answer goes to.
#pragma once

#include <grpcpp/generic/generic_stub.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>

#include "front/admission.h"
#include "front/batcher.h"
#include "front/stats.h"
#include "front/tables.h"

namespace recship::front {

// The start arguments (recship_front.cpp says them).
struct Config {
  std::string listen, backend;
  Batching defaults;
  int64_t max_message_bytes = rules::kMaxMessageBytesDefault;
  int64_t max_inflight_bytes = rules::kMaxInflightBytesDefault;
  std::string tls_cert, tls_key, tls_client_ca;
  Tables tables;
};

class Front {
 public:
  explicit Front(Config c);

  // The batcher of `name` if it serves `version` (0: whichever it serves), else null.
  std::shared_ptr<Batcher> route(const std::string& name, int64_t version);

  // Loads a version (verified, self-checked) and routes `name` to it; the version it replaces finishes what it
  // has queued, then goes. Returns the format it runs; throws what the loader threw.
  std::string load(const std::string& name, int64_t version, const std::string& path, const std::string& format,
                   const Batching& settings, const std::optional<std::string>& manifest_sha256);
  void unload(const std::string& name);
  void unload_all();
  // Every served version's batch runs without waiting for company from now on (no more calls come: stopping).
  void close_windows();

  // The gauges' values now: calls waiting per served version, and request bytes in flight.
  json gauges();

  const Config config;
  Stats stats;
  Admission admission;
  DeviceThread device;  // one forward at a time on this process's CPU, across models, on one thread (as the Python server)
  std::atomic<bool> accepting{true};
  grpc::GenericStub stub;

 private:
  std::shared_mutex mu_;
  std::map<std::string, std::shared_ptr<Batcher>> served_;
};

}  // namespace recship::front
