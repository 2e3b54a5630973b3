#include "front/tables.h"

#include <cctype>
#include <cmath>
#include <set>
#include <stdexcept>

namespace recship::front {

namespace {

std::runtime_error wrong(const std::string& why) { return std::runtime_error("--tables: " + why); }

// "key" at the top, "where.key" inside `where`: how the messages name a value.
std::string path(const std::string& where, const std::string& key) { return where.empty() ? key : where + "." + key; }

// object[key], which must be there.
const json& member(const json& object, const std::string& key, const std::string& where) {
  if (!object.is_object() || !object.contains(key)) throw wrong("no " + path(where, key));
  return object.at(key);
}

// Refuses keys of `object` that are not `known`: a table the front would not use is a table it does not share.
void only(const json& object, const std::set<std::string>& known, const std::string& where) {
  if (!object.is_object()) throw wrong(where + " must be an object");
  for (const auto& [key, _] : object.items())
    if (known.count(key) == 0) throw wrong(path(where, key) + " is not one the front uses");
}

std::string text(const json& object, const std::string& key, const std::string& where) {
  const json& v = member(object, key, where);
  if (!v.is_string() || v.get<std::string>().empty()) throw wrong(path(where, key) + " must be a non-empty string");
  return v.get<std::string>();
}

// The fields a str.format template names ({name}; "{{" and "}}" are braces), refusing what Refusal::say cannot fill
// (a format spec, a conversion, an index, a lone brace).
std::set<std::string> fields_of(const std::string& message, const std::string& where) {
  std::set<std::string> fields;
  for (size_t i = 0; i < message.size(); ++i) {
    const char c = message[i];
    if ((c == '{' || c == '}') && i + 1 < message.size() && message[i + 1] == c) {
      ++i;
    } else if (c == '{') {
      const size_t end = message.find('}', i);
      const std::string name = end == std::string::npos ? "" : message.substr(i + 1, end - i - 1);
      bool word = !name.empty() && !std::isdigit(static_cast<unsigned char>(name[0]));
      for (char n : name) word = word && (std::isalnum(static_cast<unsigned char>(n)) || n == '_');
      if (!word) throw wrong(where + " is not a template whose fields are {name}s: " + message);
      fields.insert(name);
      i = end;
    } else if (c == '}') {
      throw wrong(where + " has a lone '}': " + message);
    }
  }
  return fields;
}

std::string listed(const std::set<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "{" : ", {") + n + "}";
  return out.empty() ? "none" : out;
}

Refusal refusal(const json& refusals, const std::string& key, const std::set<std::string>& fields) {
  const std::string where = "refusals." + key;
  const json& r = member(refusals, key, "refusals");
  only(r, {"code", "status", "message"}, where);
  const json& code = member(r, "code", where);
  if (!code.is_number_integer() || code.get<int64_t>() < 1 || code.get<int64_t>() > 16)
    throw wrong(where + ".code must be a gRPC status code from 1 to 16, got " + code.dump());
  Refusal out;
  out.code = static_cast<grpc::StatusCode>(code.get<int>());
  out.status = text(r, "status", where);
  out.message = text(r, "message", where);
  const std::set<std::string> named = fields_of(out.message, where + ".message");
  if (named != fields) throw wrong(where + ".message names " + listed(named) + "; the front fills " + listed(fields));
  return out;
}

std::vector<double> buckets(const json& tables, const std::string& key) {
  const json& b = member(tables, key, "");
  bool ok = b.is_array() && !b.empty();
  for (size_t i = 0; ok && i < b.size(); ++i)
    ok = b[i].is_number() && std::isfinite(b[i].get<double>()) && (i == 0 || b[i - 1].get<double>() < b[i].get<double>());
  if (!ok) throw wrong(key + " must be increasing finite numbers, got " + b.dump());
  return b.get<std::vector<double>>();
}

json refusal_json(const Refusal& r) { return {{"code", static_cast<int>(r.code)}, {"status", r.status}, {"message", r.message}}; }

}  // namespace

std::string Refusal::say(const std::map<std::string, std::string>& fields) const {
  std::string out;
  for (size_t i = 0; i < message.size(); ++i) {
    const char c = message[i];
    if ((c == '{' || c == '}') && i + 1 < message.size() && message[i + 1] == c) {
      out += c;
      ++i;
    } else if (c == '{') {
      const size_t end = message.find('}', i);
      out += fields.at(message.substr(i + 1, end - i - 1));
      i = end;
    } else {
      out += c;
    }
  }
  return out;
}

Tables Tables::parse(const std::string& source) {
  json j;
  try {
    j = json::parse(source);
  } catch (const json::parse_error& e) {
    throw wrong(std::string("not JSON: ") + e.what());
  }
  if (!j.is_object()) throw wrong("must be a JSON object, got " + j.dump());
  only(j, {"latency_buckets", "batch_buckets", "log_interval_s", "log_max_kinds", "answered", "refusals"}, "");
  Tables t;
  t.latency_buckets = buckets(j, "latency_buckets");
  t.batch_buckets = buckets(j, "batch_buckets");
  const json& interval = member(j, "log_interval_s", "");
  if (!interval.is_number() || !(interval.get<double>() > 0) || !std::isfinite(interval.get<double>()))
    throw wrong("log_interval_s must be a positive number of seconds, got " + interval.dump());
  t.log_interval_s = interval.get<double>();
  const json& kinds = member(j, "log_max_kinds", "");
  if (!kinds.is_number_integer() || kinds.get<int64_t>() < 1)
    throw wrong("log_max_kinds must be a positive integer, got " + kinds.dump());
  t.log_max_kinds = kinds.get<int64_t>();
  t.answered = text(j, "answered", "");
  const json& r = member(j, "refusals", "");
  only(r, {"cancelled", "deadline", "queue_full", "overloaded", "internal"}, "refusals");
  t.cancelled = refusal(r, "cancelled", {});
  t.deadline = refusal(r, "deadline", {});
  t.queue_full = refusal(r, "queue_full", {"max_queue"});
  t.overloaded = refusal(r, "overloaded", {"total", "limit"});
  t.internal = refusal(r, "internal", {"type", "error"});
  return t;
}

json Tables::to_json() const {
  return {{"latency_buckets", latency_buckets},
          {"batch_buckets", batch_buckets},
          {"log_interval_s", log_interval_s},
          {"log_max_kinds", log_max_kinds},
          {"answered", answered},
          {"refusals",
           {{"cancelled", refusal_json(cancelled)},
            {"deadline", refusal_json(deadline)},
            {"queue_full", refusal_json(queue_full)},
            {"overloaded", refusal_json(overloaded)},
            {"internal", refusal_json(internal)}}}};
}

}  // namespace recship::front
