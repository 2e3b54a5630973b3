#include "front/log.h"

#include <google/protobuf/stubs/common.h>
#include <grpc/support/log.h>

#include <cassert>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <tuple>
#include <utility>
#include <vector>

// protobuf's and gRPC's own log lines are routed through the front's sampled log where the library still lets a
// program do so (protobuf < 22 and gRPC < 1.65: later both log through absl, straight to stderr as before)
#if __has_include(<grpcpp/version_info.h>)
#include <grpcpp/version_info.h>
#endif
#define RECSHIP_PROTOBUF_LOG_HANDLER (GOOGLE_PROTOBUF_VERSION < 4022000)
#if RECSHIP_PROTOBUF_LOG_HANDLER
#include <google/protobuf/stubs/logging.h>
#endif
#if defined(GRPC_CPP_VERSION_MAJOR) && GRPC_CPP_VERSION_MAJOR == 1 && GRPC_CPP_VERSION_MINOR < 65
#define RECSHIP_GRPC_LOG_FUNCTION 1
#else
#define RECSHIP_GRPC_LOG_FUNCTION 0
#endif

namespace recship::front {

void log_line(const std::string& level, const std::string& message, const nlohmann::json& fields) {
  nlohmann::json line = fields;
  line.update({{"level", level}, {"logger", "recship.front"}, {"message", message}});
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  std::cerr << line.dump() << std::endl;
}

std::string message_kind(const std::string& message) {
  std::string out;
  const size_t n = message.size();
  size_t i = 0;
  while (i < n) {
    const char c = message[i];
    if (c >= '0' && c <= '9') {
      while (i < n && message[i] >= '0' && message[i] <= '9') ++i;
      out += '#';
    } else if (c == '\'' || c == '"') {
      const size_t end = message.find(c, i + 1);
      i = end == std::string::npos ? n : end + 1;
      out += c;
      out += c;
    } else {
      out += c;
      ++i;
    }
  }
  return out;
}

SampledLog::SampledLog(double interval_s, int64_t max_kinds)
    : interval_s_(interval_s),
      interval_(std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(interval_s))),
      max_kinds_(max_kinds) {}

void SampledLog::log(const std::string& source, const std::string& level, const std::string& message, const nlohmann::json& fields) {
  std::string line;
  std::string kind = message_kind(message);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto found = sources_.find({source, kind});
    if (found == sources_.end()) {
      int64_t& kinds = kinds_[source];
      if (kinds >= max_kinds_) kind = "*";  // past max_kinds: one count for the rest
      else ++kinds;
      found = sources_.try_emplace({source, kind}).first;
    }
    Source& s = found->second;
    const auto now = Clock::now();
    s.level = level;
    s.last = message;
    s.fields = fields;
    if (s.logged && now < s.next) {
      ++s.suppressed;
      return;
    }
    line = message + note(s.suppressed);
    s.logged = true;
    s.next = now + interval_;
    s.suppressed = 0;
  }
  log_line(level, line, fields);
}

void SampledLog::flush() {
  std::vector<std::tuple<std::string, std::string, nlohmann::json>> lines;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [_, s] : sources_)
      if (s.suppressed > 0) {
        lines.emplace_back(s.level, s.last + note(s.suppressed - 1) + " (the last of " + std::to_string(s.suppressed) +
                                        " not logged)", s.fields);
        s.suppressed = 0;
      }
  }
  for (const auto& [level, line, fields] : lines) log_line(level, line, fields);
}

std::string SampledLog::note(int64_t suppressed) const {
  if (suppressed == 0) return "";
  std::ostringstream seconds;  // as Python's "{:g}": 10.0 is "10"
  seconds << interval_s_;
  return " [" + std::to_string(suppressed) + " more like this in the last " + seconds.str() + " s not logged]";
}

namespace {

SampledLog* the_sampled_log = nullptr;

// gRPC core's lines while the server starts (start_log, release_start_logs).
struct StartLogs {
  std::mutex mu;
  bool holding = true;
  std::vector<std::pair<std::string, std::string>> held;  // (level, message)
};
StartLogs& start_logs() {
  static StartLogs* logs = new StartLogs;  // never destroyed, as the sampled log
  return *logs;
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

#if RECSHIP_GRPC_LOG_FUNCTION
// gRPC core's log lines: errors sampled (a client can cause one per connection, e.g. a failed TLS handshake), the
// rest (GRPC_VERBOSITY=debug or info) as they come; held while the server starts.
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

}  // namespace

SampledLog& sampled_log() {
  assert(the_sampled_log != nullptr && "start_log comes first");
  return *the_sampled_log;
}

void start_log(double interval_s, int64_t max_kinds) {
  assert(the_sampled_log == nullptr);
  the_sampled_log = new SampledLog(interval_s, max_kinds);
#if RECSHIP_PROTOBUF_LOG_HANDLER
  google::protobuf::SetLogHandler(protobuf_log);
#endif
#if RECSHIP_GRPC_LOG_FUNCTION
  gpr_set_log_function(grpc_log);
#endif
}

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

std::optional<std::string> first_start_error() {
  StartLogs& start = start_logs();
  std::lock_guard<std::mutex> lock(start.mu);
  for (const auto& [level, message] : start.held)
    if (level == "ERROR") return message.substr(0, 500);
  return std::nullopt;
}

}  // namespace recship::front
