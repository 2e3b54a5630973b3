#include "front/control.h"

#include <iostream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>

#include "front/front.h"
#include "front/log.h"

namespace recship::front {

namespace {

std::string number(double x) {  // as Python's "{:g}": 60000.0 is "60000"
  std::ostringstream out;
  out << x;
  return out.str();
}

}  // namespace

Batching batching_of(const json& given, const Batching& defaults) {
  Batching settings = defaults;
  settings.max_batch_size = given.value("max_batch_size", settings.max_batch_size);
  settings.max_delay_ms = given.value("max_delay_ms", settings.max_delay_ms);
  settings.batching = given.value("batching", settings.batching);
  settings.max_queue = given.value("max_queue", settings.max_queue);
  settings.torch_threads = given.value("torch_threads", settings.torch_threads);
  // the bounds of the serving rules (recship/serving_rules.h), as ServerConfig checks them in Python
  if (settings.max_batch_size < rules::kMaxBatchSizeMin)
    throw std::runtime_error("settings: max_batch_size must be >= " + std::to_string(rules::kMaxBatchSizeMin) + ", got " +
                             std::to_string(settings.max_batch_size));
  if (settings.max_queue < rules::kMaxQueueMin)
    throw std::runtime_error("settings: max_queue must be >= " + std::to_string(rules::kMaxQueueMin) + ", got " +
                             std::to_string(settings.max_queue));
  if (!(settings.max_delay_ms >= rules::kMaxDelayMsMin && settings.max_delay_ms <= rules::kMaxDelayMsMax))
    throw std::runtime_error("settings: max_delay_ms must be from " + number(rules::kMaxDelayMsMin) + " to " +
                             number(rules::kMaxDelayMsMax) + ", got " + number(settings.max_delay_ms));
  if (settings.torch_threads < 0) throw std::runtime_error("settings: torch_threads must be >= 0, got " + std::to_string(settings.torch_threads));
  return settings;
}

void reply(const json& answer) { std::cout << answer.dump() << std::endl; }

double run_commands(Front& front, std::istream& in) {
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    try {
      json cmd = json::parse(line);
      const std::string op = cmd.at("op").get<std::string>();
      if (op == "load") {
        // the model's own config.yaml values ("settings") override the server's
        const Batching settings = batching_of(cmd.value("settings", json::object()), front.config.defaults);
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
      } else if (op == "tables") {
        reply({{"ok", true}, {"tables", front.config.tables.to_json()}});
      } else if (op == "message_kind") {  // the sampled log's rule, for the test that holds it to Python's
        reply({{"ok", true}, {"kind", message_kind(cmd.at("message").get<std::string>())}});
      } else if (op == "stop") {
        return cmd.value("grace_s", 5.0);
      } else {
        reply({{"ok", false}, {"error", "unknown op " + op}});
      }
    } catch (const std::exception& e) {
      reply({{"ok", false}, {"error", e.what()}});
    }
  }
  return 5.0;
}

}  // namespace recship::front
