#include "front/stats.h"

#include <algorithm>
#include <chrono>

namespace recship::front {

void Histogram::observe(double x) {
  counts[std::lower_bound(bounds.begin(), bounds.end(), x) - bounds.begin()] += 1;  // le: x <= bound
  sum += x;
}

ModelStats& Stats::model(const std::string& name, const std::string& version) {
  return models_.try_emplace({name, version}, latency_buckets_, batch_buckets_).first->second;
}

void Stats::request(const std::string& model_name, const std::string& version, const std::string& status, bool ok, double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  requests_[{model_name, version, status}] += 1;
  ModelStats& m = model(model_name, version);
  m.latency.observe(seconds);
  if (model_name != kUnrouted) (ok ? m.success : m.fail).add(1, seconds);
}

void Stats::batch(const std::string& model_name, const std::string& version, int64_t examples, const std::vector<double>& queue_s,
                  double compute_s, int64_t ids) {
  std::lock_guard<std::mutex> lock(mu_);
  ModelStats& m = model(model_name, version);
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
  m.last_inference_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  m.batches[examples].add(1, compute_s);
}

json Stats::to_json() {
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

}  // namespace recship::front
