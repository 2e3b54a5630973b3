// What the front must count and say exactly as the Python server does: the histograms' buckets, the status names
// of its outcomes and the gRPC code and message of each refusal it makes itself. The front holds no copy of them:
// serving/front.py sends them at start (--tables JSON, front_tables(): the serving rules, serving/rules.py, with
// serving/grpc_status.py's codes), and the "tables" command answers what the front took.
#pragma once

#include <grpcpp/support/status.h>

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace recship::front {

using json = nlohmann::json;

// A refusal the front makes itself: its gRPC code, its status in the metrics and the log, and its message as a
// Python str.format template whose {name}s Refusal::say fills.
struct Refusal {
  grpc::StatusCode code = grpc::StatusCode::UNKNOWN;
  std::string status, message;

  // The message with its fields filled in (the fields it names, checked when the tables were read).
  std::string say(const std::map<std::string, std::string>& fields = {}) const;
  grpc::Status grpc_status(const std::map<std::string, std::string>& fields = {}) const { return grpc::Status(code, say(fields)); }
};

struct Tables {
  std::vector<double> latency_buckets, batch_buckets;  // histogram bounds, increasing (Prometheus' le)
  double log_interval_s = 0;                           // SampledLog's interval
  int64_t log_max_kinds = 0;                           // SampledLog's kinds counted apart per source
  std::string answered;                                // the status of an answered request
  Refusal cancelled;                                   // the client gave up while queued
  Refusal deadline;                                    // the call's deadline came while it waited
  Refusal queue_full;                                  // {max_queue}
  Refusal overloaded;                                  // request bytes in flight: {total}, {limit}
  Refusal internal;                                    // the forward failed: {type}, {error}

  // Reads the JSON of front_tables(); std::runtime_error naming what is missing or wrong.
  static Tables parse(const std::string& source);
  json to_json() const;
};

}  // namespace recship::front
