// recship_load --target HOST:PORT --request FILE [--concurrency N] [--seconds S]: a gRPC load generator for benchmarks.
//
// Sends the raw bytes of FILE (one serialized request message) to a unary method with grpc::GenericStub, from N
// callers that each keep exactly one call outstanding, and prints one JSON object: counted OK requests, errors by
// status code, rps, latency percentiles and the generator's own CPU time. The completions run on gRPC's callback
// threads (no thread per caller), so the generator costs little CPU next to the server it measures.
//
//   recship_load --target 127.0.0.1:50051 --request req.bin --concurrency 32 --seconds 3
#include <sys/resource.h>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "args.h"

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

static const char* kUsage =
    "usage: recship_load --target HOST:PORT --request FILE [--request FILE ...] [--method M] [--concurrency N]\n"
    "                    [--seconds S] [--warmup-seconds W] [--channels C] [--timeout-ms T] [--max-requests R]\n"
    "\n"
    "Sends FILE's bytes (one serialized request message) to a unary gRPC method from N callers, each keeping one\n"
    "call outstanding, and prints one JSON object: requests, errors, first_error, seconds, rps, p50_ms, p90_ms,\n"
    "p99_ms, max_ms and cpu_seconds (the generator's own CPU time in the measured window).\n"
    "\n"
    "  --target HOST:PORT    the server\n"
    "  --method M            full method name (default /recship.serving.v1.Predictor/Predict)\n"
    "  --request FILE        a serialized request; several may be given, caller k sends file k % nfiles\n"
    "  --concurrency N       callers, one call outstanding each (default 32)\n"
    "  --seconds S           measured seconds (default 3)\n"
    "  --warmup-seconds W    seconds run first and not counted (default 0.5)\n"
    "  --channels C          separate connections, callers spread round-robin (default 0: min(N, 8))\n"
    "  --timeout-ms T        deadline of every call (default 30000)\n"
    "  --max-requests R      stop after R counted calls, OK or not (default 0: no bound)\n"
    "  -h, --help            print this and exit\n"
    "\n"
    "Exit codes: 0 it ran (errors are counted in the JSON), 1 the target cannot be reached, 2 bad arguments.\n";

static const char* code_name(grpc::StatusCode c) {
  static const char* names[] = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
                                "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
                                "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
                                "UNAUTHENTICATED"};
  int i = static_cast<int>(c);
  return i >= 0 && i <= 16 ? names[i] : "UNKNOWN";
}

static double cpu_now() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

static double percentile(std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  return sorted[std::min(sorted.size() - 1, static_cast<size_t>(p * sorted.size()))];
}

enum Phase { kWarmup = 0, kMeasure = 1, kStop = 2 };

// What the callers share; the counters a caller writes are its own (its completions never overlap).
struct Run {
  std::string method;
  int timeout_ms = 30000;
  int64_t max_requests = 0;
  std::atomic<int> phase{kWarmup};
  std::atomic<bool> stop{false};          // --max-requests reached, or the target is unreachable
  std::atomic<bool> unreachable{false};
  std::atomic<int64_t> counted{0};        // calls completed in the measured window, OK or not
  std::atomic<int64_t> ok_ever{0};        // OK responses, warmup included
  std::mutex mu;
  std::condition_variable cv;
  int active = 0;                         // callers still running
  Clock::time_point stop_time;            // when the R-th counted call completed
  std::string first_error;
};

struct Caller {
  Run* run = nullptr;
  grpc::GenericStub* stub = nullptr;
  grpc::ByteBuffer request, response;
  std::mutex mu;                          // guards ctx against the cancel sweep at the end
  std::unique_ptr<grpc::ClientContext> ctx;
  Clock::time_point sent;
  std::vector<double> latencies_ms;
  std::map<std::string, int64_t> errors;  // counted errors
  std::map<std::string, int64_t> early_errors;  // errors outside the window, reported only when unreachable

  void finish() {
    std::lock_guard<std::mutex> lk(run->mu);
    if (--run->active == 0) run->cv.notify_all();  // notified under the lock: main cannot free the cv meanwhile
  }

  void start() {
    grpc::ClientContext* c;
    {
      std::lock_guard<std::mutex> lk(mu);
      if (run->phase.load() == kStop || run->stop.load()) {
        ctx.reset();
        c = nullptr;
      } else {
        ctx = std::make_unique<grpc::ClientContext>();  // the previous call's context, done with by now
        ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(run->timeout_ms));
        response.Clear();
        sent = Clock::now();
        c = ctx.get();
      }
    }
    if (!c) return finish();
    stub->UnaryCall(c, run->method, grpc::StubOptions(), &request, &response,
                    [this](grpc::Status s) { done(s); });
  }

  void done(const grpc::Status& s) {
    auto now = Clock::now();
    int phase = run->phase.load();
    if (s.ok()) ++run->ok_ever;
    if (phase == kMeasure && !run->stop.load()) {
      int64_t n = ++run->counted;
      if (run->max_requests == 0 || n <= run->max_requests) {
        if (s.ok()) latencies_ms.push_back(std::chrono::duration<double, std::milli>(now - sent).count());
        else ++errors[code_name(s.error_code())];
        if (!s.ok()) {
          std::lock_guard<std::mutex> lk(run->mu);
          if (run->first_error.empty()) run->first_error = s.error_message().empty() ? code_name(s.error_code()) : s.error_message();
        }
        if (run->max_requests > 0 && n == run->max_requests) {
          std::lock_guard<std::mutex> lk(run->mu);
          run->stop_time = now;
          run->stop = true;
          run->cv.notify_all();
        }
      }
    } else if (!s.ok() && phase != kStop) {
      ++early_errors[code_name(s.error_code())];
    }
    if (!s.ok() && s.error_code() == grpc::StatusCode::UNAVAILABLE && phase != kStop && run->ok_ever.load() == 0) {
      // the first answer is UNAVAILABLE: the target cannot be reached, give up at once
      std::lock_guard<std::mutex> lk(run->mu);
      if (run->first_error.empty()) run->first_error = s.error_message();
      run->unreachable = true;
      run->stop = true;
      run->cv.notify_all();
    }
    start();
  }
};

static bool parse_args(int argc, char** argv, std::string& target, std::string& method, std::vector<std::string>& files,
                       int& concurrency, double& seconds, double& warmup, int& channels, int& timeout_ms,
                       int64_t& max_requests, std::string& err) {
  recship::args::Flags flags;
  flags.text("--target", &target).text("--method", &method).texts("--request", &files);
  flags.integer("--concurrency", &concurrency).number("--seconds", &seconds).number("--warmup-seconds", &warmup);
  flags.integer("--channels", &channels).integer("--timeout-ms", &timeout_ms).integer("--max-requests", &max_requests);
  using Kind = recship::args::Problem::Kind;
  const recship::args::Problem p = flags.parse(argc, argv);
  if (p.kind == Kind::kMissingValue) err = "unknown argument or missing value: " + p.flag;
  else if (p.kind == Kind::kUnknown) err = "unknown argument " + p.flag;
  else if (p) err = "not a number: " + p.flag + " " + p.value;
  else if (target.empty()) err = "--target is required";
  else if (files.empty()) err = "--request is required";
  else if (method.empty() || method[0] != '/') err = "--method must look like /package.Service/Method";
  else if (concurrency < 1) err = "--concurrency must be at least 1";
  else if (!(seconds > 0) || seconds > 1e6) err = "--seconds must be positive";
  else if (!(warmup >= 0) || warmup > 1e6) err = "--warmup-seconds must be 0 or more";
  else if (channels < 0) err = "--channels must be 0 or more";
  else if (timeout_ms < 1) err = "--timeout-ms must be at least 1";
  else if (max_requests < 0) err = "--max-requests must be 0 or more";
  return err.empty();
}

int main(int argc, char** argv) {
  if (recship::args::wants_help(argc, argv)) {
    std::cout << kUsage;
    return 0;
  }
  std::string target, method = "/recship.serving.v1.Predictor/Predict", err;
  std::vector<std::string> files;
  int concurrency = 32, channels = 0, timeout_ms = 30000;
  double seconds = 3, warmup = 0.5;
  int64_t max_requests = 0;
  if (!parse_args(argc, argv, target, method, files, concurrency, seconds, warmup, channels, timeout_ms, max_requests, err)) {
    std::cerr << "recship_load: error: " << err << " (see --help)\n";
    return 2;
  }
  std::vector<grpc::Slice> requests;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    if (!in) {
      std::cerr << "recship_load: error: cannot read request file " << f << "\n";
      return 2;
    }
    std::stringstream ss;
    ss << in.rdbuf();
    requests.emplace_back(ss.str());
  }
  if (channels == 0) channels = std::min(concurrency, 8);

  Run run;
  run.method = method;
  run.timeout_ms = timeout_ms;
  run.max_requests = max_requests;
  json out = {{"requests", 0},   {"errors", json::object()}, {"first_error", ""}, {"seconds", 0.0},
              {"rps", 0.0},      {"p50_ms", 0.0},            {"p90_ms", 0.0},      {"p99_ms", 0.0},
              {"max_ms", 0.0},   {"cpu_seconds", 0.0}};

  // Separate channels (a local subchannel pool each, so separate TCP connections), all connected before starting.
  std::vector<std::shared_ptr<grpc::Channel>> chans;
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs;
  auto connect_deadline = std::chrono::system_clock::now() + std::chrono::seconds(10);
  for (int c = 0; c < channels; ++c) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt("recship.channel_id", c);
    args.SetMaxReceiveMessageSize(-1);
    args.SetMaxSendMessageSize(-1);
    chans.push_back(grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args));
    stubs.push_back(std::make_unique<grpc::GenericStub>(chans.back()));
  }
  for (int c = 0; c < channels; ++c) {
    auto& ch = chans[c];
    // WaitForConnected, except that a refused connection (TRANSIENT_FAILURE) ends the wait at once
    grpc_connectivity_state state;
    while ((state = ch->GetState(true)) != GRPC_CHANNEL_READY && state != GRPC_CHANNEL_TRANSIENT_FAILURE &&
           state != GRPC_CHANNEL_SHUTDOWN)
      if (!ch->WaitForStateChange(state, connect_deadline)) break;
    state = ch->GetState(false);
    if (state != GRPC_CHANNEL_READY) {
      // one call for the reason (e.g. "failed to connect to all addresses; ... Connection refused")
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
      grpc::ByteBuffer req(&requests[0], 1), resp;
      std::mutex m;
      std::condition_variable cv;
      bool finished = false;
      grpc::Status status;
      stubs[c]->UnaryCall(&ctx, method, grpc::StubOptions(), &req, &resp, [&](grpc::Status s) {
        std::lock_guard<std::mutex> lk(m);
        status = s;
        finished = true;
        cv.notify_all();
      });
      std::unique_lock<std::mutex> lk(m);
      cv.wait(lk, [&] { return finished; });
      if (!status.ok()) {
        out["errors"][code_name(status.error_code())] = 1;
        out["first_error"] = std::string("cannot connect to ") + target + ": " + status.error_message();
      } else {
        out["first_error"] = "not connected to " + target + " after 10 s";
      }
      std::cout << out.dump() << std::endl;
      return 1;
    }
  }

  std::vector<std::unique_ptr<Caller>> callers;
  for (int k = 0; k < concurrency; ++k) {
    auto c = std::make_unique<Caller>();
    c->run = &run;
    c->stub = stubs[k % channels].get();
    c->request = grpc::ByteBuffer(&requests[k % requests.size()], 1);
    callers.push_back(std::move(c));
  }
  run.active = concurrency;
  Clock::time_point t0, t1;
  double cpu0 = 0, cpu1 = 0;
  auto begin_measure = [&] {
    t0 = Clock::now();
    cpu0 = cpu_now();
    run.phase = kMeasure;
  };
  if (warmup == 0) begin_measure();
  for (auto& c : callers) c->start();
  {
    std::unique_lock<std::mutex> lk(run.mu);
    auto over = [&] { return run.stop.load() || run.active == 0; };
    if (warmup > 0) {
      run.cv.wait_for(lk, std::chrono::duration<double>(warmup), over);
      begin_measure();
    }
    run.cv.wait_until(lk, t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds)), over);
    run.phase = kStop;
    t1 = (max_requests > 0 && run.stop && !run.unreachable) ? run.stop_time : Clock::now();
    cpu1 = cpu_now();
  }
  // cancel the calls still in flight (a caller starting one after this sees kStop), then wait for every callback
  for (auto& c : callers) {
    std::lock_guard<std::mutex> lk(c->mu);
    if (c->ctx) c->ctx->TryCancel();
  }
  {
    std::unique_lock<std::mutex> lk(run.mu);
    run.cv.wait(lk, [&] { return run.active == 0; });
  }

  std::vector<double> lat;
  std::map<std::string, int64_t> errors;
  for (auto& c : callers) {
    lat.insert(lat.end(), c->latencies_ms.begin(), c->latencies_ms.end());
    for (const auto& [k, n] : c->errors) errors[k] += n;
    if (run.unreachable)
      for (const auto& [k, n] : c->early_errors) errors[k] += n;
  }
  std::sort(lat.begin(), lat.end());
  double secs = std::max(0.0, std::chrono::duration<double>(t1 - t0).count());
  out["requests"] = lat.size();
  out["errors"] = errors.empty() ? json::object() : json(errors);
  out["first_error"] = run.first_error;
  out["seconds"] = secs;
  out["rps"] = secs > 0 ? lat.size() / secs : 0.0;
  out["p50_ms"] = percentile(lat, 0.5);
  out["p90_ms"] = percentile(lat, 0.9);
  out["p99_ms"] = percentile(lat, 0.99);
  out["max_ms"] = lat.empty() ? 0.0 : lat.back();
  out["cpu_seconds"] = cpu1 - cpu0;
  std::cout << out.dump() << std::endl;
  return run.unreachable && run.ok_ever == 0 ? 1 : 0;
}
