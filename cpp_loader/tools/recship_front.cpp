// recship_front: the C++ gRPC front of `recship serve --front cpp`. It listens on the server's gRPC port and
// answers recship.serving.v1.Predictor/Predict itself (parsing, validation, dynamic batching and the forward in
// C++: no Python per request) for the model versions the Python server tells it to serve. Every other call goes
// byte for byte to the Python server behind it (--backend), which answers as it always does: other methods
// (KServe v2, metadata, health, reflection), models or versions the front does not serve, and every Predict the
// front would refuse (it cannot parse it, a check fails, it is over the size limit), so error statuses and
// messages are the Python server's own.
//
//   recship_front --listen HOST:PORT --backend ADDRESS [--max-batch-size 512] [--max-delay-ms 2] [--batching 1] [--max-queue 1024]
//                 [--max-message-bytes N] [--max-inflight-bytes N] [--threads N]
//                 [--tls-cert PEM --tls-key PEM [--tls-client-ca PEM]]
//
// The Python server is the control plane: one JSON command a line on stdin, one JSON answer a line on stdout:
//   {"op": "load", "model": M, "version": V, "path": DIR, "format": "auto", "settings": {...}} -> {"ok": true, "format": "aoti"}
//     (settings, optional: max_batch_size, max_delay_ms, batching, max_queue, threads: the model's own, else the flags';
//     manifest_sha256, optional: the only manifest.json it may load, the one Python verified: LoadOptions::trusted)
//   {"op": "unload", "model": M}                                           -> {"ok": true}
//   {"op": "stats"}                                                         -> {"ok": true, "stats": [...]}
//   {"op": "stop", "grace_s": 5}                                            -> {"ok": true}, then it exits
// (an error answers {"ok": false, "error": "..."}). The first stdout line is {"listening": PORT}; stdin closing
// (the parent is gone) stops the front as "stop" does. Log lines go to stderr.
#include <google/protobuf/stubs/common.h>
#include <grpc/support/log.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <fstream>
#include <iostream>
#include <malloc.h>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <shared_mutex>
#include <sstream>
#include <thread>

#include "recship/model.h"
#include "recship/serving/v1/predictor.pb.h"

// protobuf's and gRPC's own log lines are routed through the front's sampled log where the library still lets a
// program do so (protobuf < 22 and gRPC < 1.65: later both log through absl, straight to stderr as before)
#if __has_include(<grpcpp/version_info.h>)
#include <grpcpp/version_info.h>
#endif
#define RECSHIP_PROTOBUF_LOG_HANDLER (GOOGLE_PROTOBUF_VERSION < 4022000)
#if defined(GRPC_CPP_VERSION_MAJOR) && GRPC_CPP_VERSION_MAJOR == 1 && GRPC_CPP_VERSION_MINOR < 65
#define RECSHIP_GRPC_LOG_FUNCTION 1
#else
#define RECSHIP_GRPC_LOG_FUNCTION 0
#endif

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
namespace pb = recship::serving::v1;

namespace {

const char* const kPredict = "/recship.serving.v1.Predictor/Predict";

// How one model version batches: the server's flags, or the model's own config.yaml (the "settings" of "load").
struct Batching {
  int64_t max_batch_size = 512;
  double max_delay_ms = 2.0;  // 0: no waiting, but calls queued during a forward still run together
  bool batching = true;       // false: every call runs alone
  int64_t max_queue = 1024;
  int threads = 0;            // intra-op threads per forward; 0: torch's default
};

struct Config {
  std::string listen, backend;
  Batching defaults;
  int64_t max_message_bytes = 64 << 20;
  int64_t max_inflight_bytes = 256 << 20;
  std::string tls_cert, tls_key, tls_client_ca;
};

void log_line(const std::string& level, const std::string& message) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  std::cerr << json{{"level", level}, {"logger", "recship.front"}, {"message", message}}.dump() << std::endl;
}

// Lines a client can cause once per request (a refusal, protobuf's or gRPC's complaint about its bytes) are
// sampled so that no client can flood the log: at most one line per interval from each source (a status, a
// library's file:line: never client data), the next one saying how many were left out. The requests themselves
// are all counted in the metrics (by the front, or by the Python server it forwards them to).
class SampledLog {
 public:
  explicit SampledLog(std::chrono::seconds interval) : interval_(interval) {}

  void log(const std::string& source, const std::string& level, const std::string& message) {
    std::string line;
    {
      std::lock_guard<std::mutex> lock(mu_);
      Source& s = sources_[source];
      const auto now = Clock::now();
      s.level = level;
      s.last = message;
      if (s.logged && now < s.next) {
        ++s.suppressed;
        return;
      }
      line = message + note(s.suppressed);
      s.logged = true;
      s.next = now + interval_;
      s.suppressed = 0;
    }
    log_line(level, line);
  }

  // Says what is still unsaid: for each source with lines left out since its last one, the last of them.
  void flush() {
    std::vector<std::pair<std::string, std::string>> lines;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [_, s] : sources_)
        if (s.suppressed > 0) {
          lines.emplace_back(s.level, s.last + note(s.suppressed - 1) + " (the last of " + std::to_string(s.suppressed) +
                                          " not logged)");
          s.suppressed = 0;
        }
    }
    for (const auto& [level, line] : lines) log_line(level, line);
  }

 private:
  struct Source {
    bool logged = false;
    Clock::time_point next;
    int64_t suppressed = 0;
    std::string level, last;
  };
  std::string note(int64_t suppressed) const {
    if (suppressed == 0) return "";
    return " [" + std::to_string(suppressed) + " more like this in the last " + std::to_string(interval_.count()) + " s not logged]";
  }

  const std::chrono::seconds interval_;
  std::mutex mu_;
  std::map<std::string, Source> sources_;
};

SampledLog& sampled_log() {
  static SampledLog* log = new SampledLog(std::chrono::seconds(10));  // never destroyed: gRPC's threads may log at exit
  return *log;
}

#if RECSHIP_PROTOBUF_LOG_HANDLER
// protobuf's own log lines ("String field ... contains invalid UTF-8 data when parsing a protocol buffer", one for
// every such request the front parses), sampled.
void protobuf_log(google::protobuf::LogLevel level, const char* file, int line, const std::string& message) {
  if (level == google::protobuf::LOGLEVEL_FATAL) {  // protobuf aborts after this: say it whole
    log_line("CRITICAL", "protobuf: " + message);
    return;
  }
  const char* name = level == google::protobuf::LOGLEVEL_INFO ? "INFO" : level == google::protobuf::LOGLEVEL_WARNING ? "WARNING" : "ERROR";
  sampled_log().log("protobuf " + std::string(file) + ":" + std::to_string(line), name, "protobuf: " + message);
}
#endif

// gRPC core's log lines: errors sampled (a client can cause one per connection, e.g. a failed TLS handshake), the
// rest (GRPC_VERBOSITY=debug or info) as they come. While the server starts they are held: a failed start says
// why in one line of its own (start_logs).
struct StartLogs {
  std::mutex mu;
  bool holding = true;
  std::vector<std::pair<std::string, std::string>> held;  // (level, message)
};
StartLogs& start_logs() {
  static StartLogs* logs = new StartLogs;  // never destroyed, as sampled_log
  return *logs;
}

#if RECSHIP_GRPC_LOG_FUNCTION
void grpc_log(gpr_log_func_args* args) {
  const std::string level = args->severity == GPR_LOG_SEVERITY_ERROR ? "ERROR" : args->severity == GPR_LOG_SEVERITY_INFO ? "INFO" : "DEBUG";
  const std::string message = std::string("grpc: ") + args->message;
  {
    StartLogs& start = start_logs();
    std::lock_guard<std::mutex> lock(start.mu);
    if (start.holding) {
      start.held.emplace_back(level, message);
      return;
    }
  }
  if (args->severity == GPR_LOG_SEVERITY_ERROR) sampled_log().log("grpc " + std::string(args->file) + ":" + std::to_string(args->line), level, message);
  else log_line(level, message);
}
#endif

// Ends holding gRPC's start-up lines: logs them (keep) or drops them (a failed start said why itself).
void release_start_logs(bool keep) {
  std::vector<std::pair<std::string, std::string>> held;
  {
    StartLogs& start = start_logs();
    std::lock_guard<std::mutex> lock(start.mu);
    start.holding = false;
    held.swap(start.held);
  }
  if (keep)
    for (const auto& [level, message] : held) log_line(level, message);
}

// Why a TCP listener cannot bind to HOST:PORT: the error of binding a plain socket to each address it resolves
// to (with SO_REUSEADDR, as gRPC binds; never SO_REUSEPORT), e.g. "address already in use", in the words
// Python's asyncio uses for the HTTP and metrics ports; empty when every address binds, or for port 0 and
// unix: addresses, which nothing else can hold.
std::string bind_error(const std::string& address) {
  if (address.rfind("unix:", 0) == 0 || address.rfind("unix-abstract:", 0) == 0) return "";
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return "";
  std::string host = address.substr(0, colon), port = address.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  if (port.empty() || port == "0") return "";
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &found) != 0) return "";
  std::string error;
  for (addrinfo* a = found; a != nullptr && error.empty(); a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 && errno != EADDRNOTAVAIL && errno != EAFNOSUPPORT) {
      error = std::strerror(errno);
      if (!error.empty()) error[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(error[0])));
    }
    close(fd);
  }
  freeaddrinfo(found);
  return error;
}

// Returns the heap's free memory to the OS (glibc; elsewhere nothing to do).
void release_memory() {
#ifdef __GLIBC__
  malloc_trim(0);
#endif
}

// -- metrics: the Python server's families (serving/metrics.py), merged into its /metrics ------------------------

// The buckets of serving/metrics.py; counts are per bucket (not cumulative), the last one past the largest bound.
const std::vector<double> kLatencyBuckets = {0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0};
const std::vector<double> kBatchBuckets = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096};

struct Histogram {
  const std::vector<double>* bounds;
  std::vector<int64_t> counts;
  double sum = 0;
  explicit Histogram(const std::vector<double>& b = kLatencyBuckets) : bounds(&b), counts(b.size() + 1, 0) {}
  void observe(double x) {
    counts[std::lower_bound(bounds->begin(), bounds->end(), x) - bounds->begin()] += 1;  // le: x <= bound
    sum += x;
  }
  json to_json() const { return {{"bounds", *bounds}, {"counts", counts}, {"sum", sum}}; }
};

// A count and a total in nanoseconds: Triton's StatisticDuration.
struct Duration {
  int64_t count = 0, ns = 0;
  void add(int64_t n, double seconds) {
    count += n;
    ns += static_cast<int64_t>(seconds * 1e9) * n;
  }
  json to_json() const { return {count, ns}; }
};

// One served version's counts: the Prometheus histograms and Triton's ModelStatistics (serving/metrics.py ModelStats).
struct ModelStats {
  Histogram latency, queue, compute, batch{kBatchBuckets};
  int64_t ids = 0;
  Duration success, fail, queued, computed;
  int64_t inference_count = 0, execution_count = 0, last_inference_ms = 0;
  std::map<int64_t, Duration> batches;  // examples per forward -> (forwards, compute ns)
};

class Stats {
 public:
  void request(const std::string& model, int64_t version, const std::string& status, double seconds) {
    std::lock_guard<std::mutex> lock(mu_);
    requests_[{model, version, status}] += 1;
    ModelStats& m = models_[{model, version}];
    m.latency.observe(seconds);
    (status == "OK" ? m.success : m.fail).add(1, seconds);
  }
  void batch(const std::string& model, int64_t version, int64_t examples, const std::vector<double>& queue_s, double compute_s,
             int64_t ids) {
    std::lock_guard<std::mutex> lock(mu_);
    ModelStats& m = models_[{model, version}];
    m.batch.observe(static_cast<double>(examples));
    m.compute.observe(compute_s);
    for (double q : queue_s) {
      m.queue.observe(q);
      m.queued.add(1, q);
    }
    m.computed.add(static_cast<int64_t>(queue_s.size()), compute_s);
    m.ids += ids;
    m.inference_count += examples;
    m.execution_count += 1;
    m.last_inference_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::system_clock::now().time_since_epoch()).count();
    m.batches[examples].add(1, compute_s);
  }
  json to_json() {
    std::lock_guard<std::mutex> lock(mu_);
    json requests = json::array(), models = json::array();
    for (const auto& [key, n] : requests_)
      requests.push_back({{"model", std::get<0>(key)}, {"version", std::get<1>(key)}, {"status", std::get<2>(key)}, {"count", n}});
    for (const auto& [key, m] : models_) {
      json batches = json::array();
      for (const auto& [size, d] : m.batches) batches.push_back({size, d.count, d.ns});
      models.push_back({{"model", key.first}, {"version", key.second}, {"latency", m.latency.to_json()},
                        {"queue", m.queue.to_json()}, {"compute", m.compute.to_json()}, {"batch", m.batch.to_json()},
                        {"ids", m.ids}, {"success", m.success.to_json()}, {"fail", m.fail.to_json()},
                        {"queued", m.queued.to_json()}, {"computed", m.computed.to_json()},
                        {"inference_count", m.inference_count}, {"execution_count", m.execution_count},
                        {"last_inference_ms", m.last_inference_ms}, {"batches", batches}});
    }
    return {{"requests", requests}, {"models", models}};
  }

 private:
  std::mutex mu_;
  std::map<std::tuple<std::string, int64_t, std::string>, int64_t> requests_;
  std::map<std::pair<std::string, int64_t>, ModelStats> models_;
};

// -- the served versions ---------------------------------------------------------------------------------------------

class Call;
class Front;

// Queues Predict calls for one model version and runs them in merged batches on one thread, as the Python
// batcher does (serving/batcher.py): the oldest call waits up to max_delay for company, a batch holds at most
// max_batch_size examples, calls whose client gave up or whose deadline passed are answered without running, a
// failing forward fails only its batch, and every call gets exactly its own rows.
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
  std::thread thread_;
};

class Front {
 public:
  explicit Front(Config c)
      : config(std::move(c)), stub(grpc::CreateCustomChannel(config.backend, grpc::InsecureChannelCredentials(), backend_args())) {}

  std::shared_ptr<Batcher> route(const std::string& name, int64_t version) {
    std::shared_lock<std::shared_mutex> lock(mu_);
    auto it = served_.find(name);
    if (it == served_.end() || (version != 0 && version != it->second->version)) return nullptr;
    return it->second;
  }

  std::string load(const std::string& name, int64_t version, const std::string& path, const std::string& format,
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

  void unload(const std::string& name) {
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

  void unload_all() {
    std::map<std::string, std::shared_ptr<Batcher>> all;
    {
      std::unique_lock<std::shared_mutex> lock(mu_);
      all.swap(served_);
    }
    for (auto& [name, b] : all) b->stop();
  }

  // Admission of request bytes in flight (the Python server's --max-inflight-mb, counted apart from its own).
  bool admit(int64_t n, int64_t* total) {
    int64_t now = inflight_.fetch_add(n) + n;
    *total = now;
    if (now <= config.max_inflight_bytes) return true;
    inflight_.fetch_sub(n);
    return false;
  }
  void release(int64_t n) { inflight_.fetch_sub(n); }

  // The gauges' values now: calls waiting per served version, and request bytes in flight.
  json gauges() {
    json pending = json::array();
    std::shared_lock<std::shared_mutex> lock(mu_);
    for (const auto& [name, b] : served_) pending.push_back({{"model", name}, {"version", b->version}, {"pending", b->pending()}});
    return {{"pending", pending}, {"inflight_bytes", inflight_.load()}};
  }

  const Config config;
  Stats stats;
  std::mutex device;  // one forward at a time on this process's CPU, across models (as the Python server does)
  std::atomic<bool> accepting{true};
  grpc::GenericStub stub;

 private:
  static grpc::ChannelArguments backend_args() {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetMaxSendMessageSize(-1);
    return args;
  }
  // Calls already queued on a replaced or unloaded version finish on it; then it goes (off the control thread).
  void retire(std::shared_ptr<Batcher> old) {
    if (old) std::thread([old]() mutable { old->stop(); old.reset(); }).detach();
  }

  std::shared_mutex mu_;
  std::map<std::string, std::shared_ptr<Batcher>> served_;
  std::atomic<int64_t> inflight_{0};
};

// -- one call ---------------------------------------------------------------------------------------------------

// One incoming call of any method. A Predict the front can serve is answered from its batcher; anything else is
// proxied to the Python server: client messages go up as they come, the server's go down, its status ends the call.
class Call : public grpc::ServerGenericBidiReactor {
 public:
  Call(Front* front, grpc::GenericCallbackServerContext* ctx) : front_(front), ctx_(ctx), started_(Clock::now()) {
    StartRead(&up_);
  }

  // -- native Predict (called by the batcher) --
  const recship::Prepared& prepared() const { return prepared_; }
  Clock::time_point enqueued() const { return enqueued_; }
  bool cancelled() const { return cancelled_.load(); }
  bool expired() const { return std::chrono::system_clock::now() > ctx_->deadline(); }

  void answer(const recship::NamedOutputs& outputs, const std::string& model, int64_t version) {
    pb::PredictResponse response;
    response.set_model_name(model);
    response.set_model_version(version);
    response.set_request_id(request_.request_id());
    for (const auto& [name, out] : outputs) {
      pb::Tensor* t = response.add_outputs();
      t->set_name(name);
      for (int64_t d : out.shape) t->add_shape(d);
      t->mutable_values()->Add(out.values.begin(), out.values.end());
    }
    std::string bytes = response.SerializeAsString();
    grpc::Slice slice(bytes);
    down_ = grpc::ByteBuffer(&slice, 1);
    finish_native(grpc::Status::OK, "OK", &down_);
  }

  void fail(grpc::StatusCode code, const std::string& label, const std::string& message) {
    finish_native(grpc::Status(code, message), label, nullptr);
  }

  // -- grpc --
  // No lock is held around a call into gRPC: the call may end (OnDone deletes this) before it returns.
  void OnReadDone(bool ok) override {
    if (proxying()) {  // the next client message, or its half-close
      if (ok) {
        upstream_.StartWrite(&up_);
      } else {  // the client is done sending (or gone): nothing more goes up
        upstream_.StartWritesDone();
        upstream_.RemoveHold();  // the sending hold (start_proxy)
      }
      return;
    }
    // a client that sent nothing or is gone, another method, or a Predict the front does not take: the Python server
    if (ok && !cancelled_ && ctx_->method() == kPredict && serve_natively()) return;
    batcher_.reset();  // routed but not taken: a proxied call must not keep that version (and its model) alive
    start_proxy(ok);
  }

  void OnWriteDone(bool ok) override {  // proxy only: a message of the Python server reached the client
    if (ok) {
      upstream_.StartRead(&down_);
    } else {  // the client is gone: no more reads upstream, so the upstream call may end
      uctx_.TryCancel();
      upstream_.RemoveHold();  // the receiving hold (start_proxy)
    }
  }

  void OnCancel() override {
    cancelled_ = true;
    if (proxying()) uctx_.TryCancel();  // (ClientContext keeps a cancel that comes before its call starts)
  }

  void OnDone() override {
    if (admitted_) front_->release(admitted_);
    delete this;
  }

 private:
  // The Predict is the front's when it parses, is within the size limit, names a version the front serves and
  // passes validation; then it is queued (or refused as the Python server would: overloaded, queue full).
  bool serve_natively() {
    if (!front_->accepting) return false;  // stopping: the Python server answers (UNAVAILABLE while it drains)
    const int64_t nbytes = static_cast<int64_t>(up_.Length());
    if (nbytes > front_->config.max_message_bytes) return false;
    std::vector<grpc::Slice> slices;
    if (!up_.Dump(&slices).ok()) return false;
    std::string bytes;
    bytes.reserve(nbytes);
    for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
    if (!request_.ParseFromString(bytes)) return false;
    batcher_ = front_->route(request_.model_name(), request_.model_version());
    if (!batcher_) return false;
    recship::Request r;
    r.batch_size = request_.batch_size();
    for (const auto& f : request_.sparse()) {
      recship::Feature& feature = r.sparse[f.name()];
      if (!feature.lengths.empty() || !feature.ids.empty() || !feature.weights.empty()) return false;  // named twice
      feature.lengths.assign(f.lengths().begin(), f.lengths().end());
      feature.ids.assign(f.ids().begin(), f.ids().end());
      feature.weights.assign(f.weights().begin(), f.weights().end());
    }
    if (static_cast<size_t>(request_.sparse_size()) != r.sparse.size()) return false;  // a name given twice
    if (request_.has_dense()) {
      r.dense_rows = request_.dense().rows();
      r.dense_cols = request_.dense().cols();
      r.dense.assign(request_.dense().values().begin(), request_.dense().values().end());
    }
    try {
      prepared_ = batcher_->model->prepare(r);
    } catch (const recship::InvalidRequest&) {
      return false;  // the Python server refuses it with its own message (and counts it)
    }
    int64_t total = 0;
    if (!front_->admit(nbytes, &total)) {
      fail(grpc::StatusCode::RESOURCE_EXHAUSTED, "RESOURCE_EXHAUSTED",
           std::to_string(total) + " bytes of requests would be in flight, over the limit of " +
               std::to_string(front_->config.max_inflight_bytes) + " (--max-inflight-mb); retry later");
      return true;
    }
    admitted_ = nbytes;
    enqueued_ = Clock::now();
    switch (batcher_->submit(this)) {
      case Batcher::Submitted::kQueued:
        return true;
      case Batcher::Submitted::kFull:
        fail(grpc::StatusCode::RESOURCE_EXHAUSTED, "RESOURCE_EXHAUSTED",
             "queue full (" + std::to_string(batcher_->settings.max_queue) + " requests waiting)");
        return true;
      case Batcher::Submitted::kStopped:  // replaced meanwhile: the Python server routes it to the new version
        front_->release(admitted_);
        admitted_ = 0;
        return false;
    }
    return false;
  }

  void finish_native(const grpc::Status& status, const std::string& label, grpc::ByteBuffer* response) {
    const double seconds = std::chrono::duration<double>(Clock::now() - started_).count();
    front_->stats.request(batcher_->name, batcher_->version, label, seconds);
    if (!status.ok())  // a sample of the refusals of each status (all are counted)
      sampled_log().log("refused " + label, "WARNING",
                        status.error_message() + " [Predict " + batcher_->name + " " + std::to_string(batcher_->version) + " " + label + "]");
    if (response != nullptr) StartWriteAndFinish(response, grpc::WriteOptions(), status);
    else Finish(status);
  }

  bool proxying() {
    std::lock_guard<std::mutex> lock(mu_);
    return proxying_;
  }

  void start_proxy(bool have_message) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      proxying_ = true;  // from here OnCancel cancels the upstream call; before, this sees cancelled_
    }
    if (cancelled_) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client"));
      return;
    }
    uctx_.set_deadline(ctx_->deadline());
    for (const auto& [key, value] : ctx_->client_metadata()) {
      std::string k(key.data(), key.size());
      if (k.rfind("grpc-", 0) == 0 || k == "user-agent" || k == "content-type" || k == "te") continue;
      uctx_.AddMetadata(k, std::string(value.data(), value.size()));
    }
    front_->stub.PrepareBidiStreamingCall(&uctx_, ctx_->method(), grpc::StubOptions(), &upstream_);
    // Two holds keep the upstream call from ending (its OnDone deletes nothing, but after it no operation may be
    // started on it) while either direction may still start one. The Python server's status can arrive while
    // one of its messages is still being written to the client, or while the client's next message (or its
    // half-close) is still being read: the StartRead / StartWrite / StartWritesDone that follows must find the
    // call alive. The receiving hold goes when the reads from upstream end (its OnReadDone false) or the client
    // stops taking messages (OnWriteDone false); the sending hold when the client's messages end (OnReadDone
    // false: StartWritesDone) or the upstream stops taking them (its OnWriteDone false).
    upstream_.AddHold();  // receiving
    upstream_.AddHold();  // sending
    upstream_.StartRead(&down_);
    if (have_message) {
      upstream_.StartWrite(&up_);
    } else {
      upstream_.StartWritesDone();
      upstream_.RemoveHold();  // sending: nothing more goes up
    }
    upstream_.StartCall();
  }

  // The client side of a proxied call.
  struct Upstream : grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
    explicit Upstream(Call* c) : call(c) {}
    void OnReadDone(bool ok) override {
      if (ok) call->StartWrite(&call->down_);  // on to the client; its OnWriteDone reads the next
      else RemoveHold();                       // receiving: no more messages, the call may end with its status
    }
    void OnWriteDone(bool ok) override {
      if (ok) call->StartRead(&call->up_);  // that one is up: read the client's next
      else RemoveHold();                     // sending: upstream takes no more, so no more reads from the client
    }
    void OnDone(const grpc::Status& status) override { call->Finish(status); }  // the last thing either side does
    Call* call;
  };

  Front* front_;
  grpc::GenericCallbackServerContext* ctx_;
  const Clock::time_point started_;
  Clock::time_point enqueued_;
  std::mutex mu_;  // guards proxying_
  std::atomic<bool> cancelled_{false};
  bool proxying_ = false;
  grpc::ByteBuffer up_, down_;
  pb::PredictRequest request_;
  recship::Prepared prepared_;
  std::shared_ptr<Batcher> batcher_;
  int64_t admitted_ = 0;
  grpc::ClientContext uctx_;
  Upstream upstream_{this};
};

// -- the batcher --------------------------------------------------------------------------------------------------

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

void Batcher::main() {
  if (settings.threads > 0) recship::set_intra_op_threads(settings.threads);
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
    if (queue_.empty() && (settings.max_delay_ms <= 0 ||  // no waiting: only what is queued already
                           !ready_.wait_until(lock, until, [this] { return stopping_ || !queue_.empty(); })))
      break;
    if (queue_.empty()) break;  // stopping: run what we have
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
  std::vector<Call*> live;
  std::vector<const recship::Prepared*> inputs;
  for (Call* call : batch) {
    if (call->cancelled()) call->fail(grpc::StatusCode::CANCELLED, "CANCELLED", "cancelled by the client");
    else if (call->expired()) call->fail(grpc::StatusCode::DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED", "deadline passed while queued");
    else {
      live.push_back(call);
      inputs.push_back(&call->prepared());
    }
  }
  if (live.empty()) return;
  const auto started = Clock::now();
  std::vector<recship::NamedOutputs> outputs;
  try {
    std::lock_guard<std::mutex> device(front_->device);
    outputs = model->predict_batch(inputs);
  } catch (const std::exception& e) {  // the model failed: this batch's calls get the error, the worker goes on
    sampled_log().log("forward failed", "ERROR", "forward failed for a batch of " + std::to_string(live.size()) + " requests: " + e.what());
    for (Call* call : live) call->fail(grpc::StatusCode::INTERNAL, "INTERNAL", std::string("Error: ") + e.what());
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
  front_->stats.batch(name, version, examples, waits, compute, ids);
  for (size_t i = 0; i < live.size(); ++i) live[i]->answer(outputs[i], name, version);
}

// -- the service and the control loop -----------------------------------------------------------------------------

class Service : public grpc::CallbackGenericService {
 public:
  explicit Service(Front* front) : front_(front) {}
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override { return new Call(front_, ctx); }

 private:
  Front* front_;
};

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

int usage(const std::string& why) {
  std::cerr << "recship_front: " << why << "\nusage: recship_front --listen HOST:PORT --backend ADDRESS [--max-batch-size N] "
               "[--max-delay-ms F] [--batching 0|1] [--max-queue N] [--max-message-bytes N] [--max-inflight-bytes N] [--threads N] "
               "[--tls-cert PEM --tls-key PEM [--tls-client-ca PEM]]\n";
  return 2;
}

void reply(const json& j) { std::cout << j.dump() << std::endl; }

}  // namespace

int main(int argc, char** argv) {
  Config c;
  try {
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      if (i + 1 >= argc) return usage(a + " needs a value");
      std::string v = argv[++i];
      if (a == "--listen") c.listen = v;
      else if (a == "--backend") c.backend = v;
      else if (a == "--max-batch-size") c.defaults.max_batch_size = std::stoll(v);
      else if (a == "--max-delay-ms") c.defaults.max_delay_ms = std::stod(v);
      else if (a == "--batching") c.defaults.batching = std::stoi(v) != 0;
      else if (a == "--max-queue") c.defaults.max_queue = std::stoll(v);
      else if (a == "--max-message-bytes") c.max_message_bytes = std::stoll(v);
      else if (a == "--max-inflight-bytes") c.max_inflight_bytes = std::stoll(v);
      else if (a == "--threads") c.defaults.threads = std::stoi(v);
      else if (a == "--tls-cert") c.tls_cert = v;
      else if (a == "--tls-key") c.tls_key = v;
      else if (a == "--tls-client-ca") c.tls_client_ca = v;
      else return usage("unknown option " + a);
    }
  } catch (const std::exception&) {
    return usage("a numeric option has a value that is not a number");
  }
  if (c.listen.empty() || c.backend.empty()) return usage("--listen and --backend are required");
  if (c.tls_cert.empty() != c.tls_key.empty()) return usage("--tls-cert and --tls-key go together");

#if RECSHIP_PROTOBUF_LOG_HANDLER
  google::protobuf::SetLogHandler(protobuf_log);
#endif
#if RECSHIP_GRPC_LOG_FUNCTION
  gpr_set_log_function(grpc_log);
#endif
  // A failed start answers {"ok": false, "error": "cannot listen on HOST:PORT: address already in use"} (one line,
  // exit 1): serving/front.py raises it and `recship serve` says it, as for its HTTP and metrics ports.
  auto cannot_start = [&](const std::string& why) {
    release_start_logs(false);
    reply({{"ok", false}, {"error", why}});
    return 1;
  };
  // A port another process listens on is refused, not shared: gRPC sets SO_REUSEPORT by default, and then two
  // servers split one port's connections between them. Checked first for every address HOST resolves to, since
  // gRPC starts when any of them binds.
  if (std::string why = bind_error(c.listen); !why.empty()) return cannot_start("cannot listen on " + c.listen + ": " + why);

  Front front(c);
  Service service(&front);
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
  if (!c.tls_cert.empty()) {
    grpc::SslServerCredentialsOptions ssl(c.tls_client_ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                                                  : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    try {
      ssl.pem_key_cert_pairs.push_back({read_file(c.tls_key), read_file(c.tls_cert)});
      if (!c.tls_client_ca.empty()) ssl.pem_root_certs = read_file(c.tls_client_ca);
    } catch (const std::exception& e) {
      return cannot_start(e.what());
    }
    credentials = grpc::SslServerCredentials(ssl);
  }
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(c.listen, credentials, &port);
  // twice the limit, as the Python server admits, so an oversized request gets its INVALID_ARGUMENT naming the size
  builder.SetMaxReceiveMessageSize(static_cast<int>(std::min<int64_t>(2 * c.max_message_bytes, INT32_MAX)));
  builder.SetMaxSendMessageSize(static_cast<int>(std::min<int64_t>(c.max_message_bytes, INT32_MAX)));
  builder.RegisterCallbackGenericService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    std::string why = bind_error(c.listen);
    if (why.empty()) {  // not a bind error: gRPC's own first complaint, else nothing more to say
      std::lock_guard<std::mutex> lock(start_logs().mu);
      for (const auto& [level, message] : start_logs().held)
        if (level == "ERROR") {
          why = message.substr(0, 500);
          break;
        }
    }
    return cannot_start("cannot listen on " + c.listen + (why.empty() ? "" : ": " + why));
  }
  release_start_logs(true);
  reply({{"listening", port}});

  double grace = 5.0;
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line.empty()) continue;
    try {
      json cmd = json::parse(line);
      const std::string op = cmd.at("op").get<std::string>();
      if (op == "load") {
        Batching settings = c.defaults;  // the model's own config.yaml values override the server's
        const json given = cmd.value("settings", json::object());
        settings.max_batch_size = given.value("max_batch_size", settings.max_batch_size);
        settings.max_delay_ms = given.value("max_delay_ms", settings.max_delay_ms);
        settings.batching = given.value("batching", settings.batching);
        settings.max_queue = given.value("max_queue", settings.max_queue);
        settings.threads = given.value("threads", settings.threads);
        if (settings.max_batch_size < 1 || settings.max_queue < 1 || settings.threads < 0)
          throw std::runtime_error("settings: max_batch_size and max_queue must be >= 1, threads >= 0");
        std::optional<std::string> manifest_sha256;
        if (cmd.contains("manifest_sha256")) manifest_sha256 = cmd.at("manifest_sha256").get<std::string>();
        std::string format = front.load(cmd.at("model").get<std::string>(), cmd.at("version").get<int64_t>(),
                                        cmd.at("path").get<std::string>(), cmd.value("format", std::string("auto")), settings,
                                        manifest_sha256);
        reply({{"ok", true}, {"format", format}});
      } else if (op == "unload") {
        front.unload(cmd.at("model").get<std::string>());
        reply({{"ok", true}});
      } else if (op == "stats") {
        json stats = front.stats.to_json();
        stats["gauges"] = front.gauges();
        reply({{"ok", true}, {"stats", stats}});
      } else if (op == "stop") {
        grace = cmd.value("grace_s", 5.0);
        break;
      } else {
        reply({{"ok", false}, {"error", "unknown op " + op}});
      }
    } catch (const std::exception& e) {
      reply({{"ok", false}, {"error", e.what()}});
    }
  }
  front.accepting = false;
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(grace * 1000)));
  front.unload_all();
  sampled_log().flush();
  reply({{"ok", true}});
  return 0;
}
