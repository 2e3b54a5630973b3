// The front's counts: the Python server's metric families (serving/metrics.py), merged into its /metrics at each
// scrape (serving/front.py CppFront.samples), and Triton's ModelStatistics (serving/metrics.py ModelStats).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>

#include "recship/serving_rules.h"
#include <tuple>
#include <utility>
#include <vector>

namespace recship::front {

using json = nlohmann::json;

inline const std::string kUnrouted = rules::kUnroutedLabel;  // the labels of a request that reached no version

// Counts per bucket (not cumulative), the last one past the largest bound.
struct Histogram {
  std::vector<double> bounds;
  std::vector<int64_t> counts;
  double sum = 0;

  explicit Histogram(std::vector<double> b) : bounds(std::move(b)), counts(bounds.size() + 1, 0) {}
  void observe(double x);
  json to_json() const { return {{"bounds", bounds}, {"counts", counts}, {"sum", sum}}; }
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

// One served version's counts: the Prometheus histograms and Triton's ModelStatistics.
struct ModelStats {
  Histogram latency, queue, compute, batch;
  int64_t ids = 0;
  Duration success, fail, queued, computed;
  int64_t inference_count = 0, execution_count = 0, last_inference_ms = 0;
  std::map<int64_t, Duration> batches;  // examples per forward -> (forwards, compute ns)

  ModelStats(const std::vector<double>& latency_buckets, const std::vector<double>& batch_buckets)
      : latency(latency_buckets), queue(latency_buckets), compute(latency_buckets), batch(batch_buckets) {}
};

class Stats {
 public:
  // The buckets of the shared tables (serving/metrics.py's): latency, queue and compute seconds; examples per forward.
  Stats(std::vector<double> latency_buckets, std::vector<double> batch_buckets)
      : latency_buckets_(std::move(latency_buckets)), batch_buckets_(std::move(batch_buckets)) {}

  // A request answered or refused (status: its status name), end to end, under its model and version labels: kUnrouted
  // for one refused before it reached a version (over the in-flight budget: the Python server admits a request
  // before it reads it), which counts in no version's statistics, as in the Python server.
  void request(const std::string& model, const std::string& version, const std::string& status, bool ok, double seconds);
  // A forward of `examples` examples: each request's wait in the queue, the forward's time, the ids looked up.
  void batch(const std::string& model, const std::string& version, int64_t examples, const std::vector<double>& queue_s, double compute_s,
             int64_t ids);
  json to_json();

 private:
  ModelStats& model(const std::string& name, const std::string& version);  // (mu_ held)

  const std::vector<double> latency_buckets_, batch_buckets_;
  std::mutex mu_;
  std::map<std::tuple<std::string, std::string, std::string>, int64_t> requests_;
  std::map<std::pair<std::string, std::string>, ModelStats> models_;
};

}  // namespace recship::front
