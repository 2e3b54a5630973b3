// The front's log: JSON lines on stderr (serving/front.py logs them as "recship.front"), the lines a client can
// cause sampled, and gRPC's and protobuf's own lines routed through it where the library lets a program do so.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

namespace recship::front {

using Clock = std::chrono::steady_clock;

// One JSON line: level, logger, message, and `fields` (what a line is about: method, model, version, status), which
// serving/front.py passes on as the record's extra fields, as the Python server logs them.
void log_line(const std::string& level, const std::string& message, const nlohmann::json& fields = nlohmann::json::object());

// What kind of error a message tells, without its values: each run of digits becomes "#" and each quoted run
// (from ' or " to the same quote, or the end) an empty pair of those quotes. The Python server's message_kind
// (serving/inference.py) is the same rule; digits and quotes are ASCII, which no byte of a multi-byte UTF-8
// character is, so bytes here and characters there give the same kind.
std::string message_kind(const std::string& message);

// Lines a client can cause once per request (a refusal, protobuf's or gRPC's complaint about its bytes) are
// sampled so that no client can flood the log: at most one line per interval from each source (a status, a
// library's file:line: never client data) and kind of message (message_kind), the next one saying how many like
// it were left out. A source's kinds past its first max_kinds share one count. The requests themselves are all
// counted in the metrics (by the front, or by the Python server it forwards them to). The same words and counts
// as the Python server's SampledLog (serving/inference.py), so that one reading of the log covers both processes.
class SampledLog {
 public:
  SampledLog(double interval_s, int64_t max_kinds);

  void log(const std::string& source, const std::string& level, const std::string& message,
           const nlohmann::json& fields = nlohmann::json::object());
  // Says what is still unsaid: for each source with lines left out since its last one, the last of them.
  void flush();

 private:
  struct Source {
    bool logged = false;
    Clock::time_point next;
    int64_t suppressed = 0;
    std::string level, last;
    nlohmann::json fields;  // the last line's
  };
  std::string note(int64_t suppressed) const;

  const double interval_s_;
  const Clock::duration interval_;
  const int64_t max_kinds_;
  std::mutex mu_;
  std::map<std::pair<std::string, std::string>, Source> sources_;  // (source, kind)
  std::map<std::string, int64_t> kinds_;                          // source -> kinds counted apart
};

// The front's one SampledLog, made by start_log (at start, with the interval of the shared tables: the Python
// server's LOG_INTERVAL_S) and never destroyed: gRPC's threads may log at exit.
SampledLog& sampled_log();

// Starts the log: the sampled log, and protobuf's and gRPC's lines through it (protobuf < 22 and gRPC < 1.65;
// later both log through absl, straight to stderr). gRPC's lines are held while the server starts: a failed start
// says why in one line of its own.
void start_log(double interval_s, int64_t max_kinds);

// Ends holding gRPC's start-up lines: logs them (keep) or drops them (a failed start said why itself).
void release_start_logs(bool keep);

// gRPC's first ERROR line while the server started, cut to 500 characters, if it said one.
std::optional<std::string> first_start_error();

}  // namespace recship::front
