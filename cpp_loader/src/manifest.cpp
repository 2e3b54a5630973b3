// The manifest checked (manifest.h): recship/contract/manifest.schema.json (schema.cpp), then the rules between fields
// of recship/contract/rules.py, in its order and words.
#include "manifest.h"

#include <map>
#include <optional>
#include <set>
#include <tuple>

#include "recship/model.h"
#include "tables.h"

namespace recship {

using json = nlohmann::json;
using schema::Problem;
using schema::Token;
using schema::Where;

namespace {

constexpr uint64_t kAlign = 4096;  // recship/contract/tables.py ALIGN

Where at(std::initializer_list<Token> tokens) { return Where(tokens); }
Token key(const std::string& k) { return {k}; }
Token index(size_t i) { return {"", true, i}; }

// A broken rule: where, its name, its words (rules.py _Broken).
struct Broken {
  Problem problem;
};

[[noreturn]] void fail(const Where& where, const std::string& rule, const std::string& text) {
  throw Broken{{where, rule, schema::said(where, text)}};
}

// The manifest's inputs, as num_dense and weighted make them (rules.py derived_inputs).
json derived_inputs(const json& num_dense, bool weighted) {
  return {
      {"dense", {{"dtype", "float32"}, {"shape", {"B", num_dense}}}},
      {"lengths", {{"dtype", "int32"}, {"shape", {"F*B"}}, {"order", "feature-major, features in the order below"}}},
      {"values", {{"dtype", "int64"}, {"shape", {"N"}}}},
      {"weights", {{"dtype", "float32"}, {"shape", {"N"}}, {"required", weighted}}},
  };
}

std::vector<uint64_t> sizes(const json& shape) {
  std::vector<uint64_t> out;
  for (const auto& d : shape) out.push_back(d.get<uint64_t>());
  return out;
}

void tables_layout(const json& spec) {
  uint64_t end = 0;
  std::set<std::string> names;
  const json& tensors = spec["tensors"];
  for (size_t i = 0; i < tensors.size(); ++i) {
    const json& t = tensors[i];
    const Where where = at({key("tables"), key("tensors"), index(i)});
    auto in = [&where](std::initializer_list<Token> more) {
      Where out = where;
      out.insert(out.end(), more);
      return out;
    };
    const std::string& name = t["name"].get_ref<const std::string&>();
    if (!names.insert(name).second) fail(in({key("name")}), "tables-layout", py_repr(name) + " names two tensors");
    if (t["shape"].size() != t["stride"].size()) fail(in({key("stride")}), "tables-layout", "must have one entry per dimension of its shape");
    const uint64_t offset = t["offset"].get<uint64_t>(), bytes = t["bytes"].get<uint64_t>();
    if (static_cast<unsigned __int128>(bytes) != tables::dtype_size(t["dtype"].get<std::string>()) *
                                                          tables::span(t["shape"].get<std::vector<int64_t>>(), t["stride"].get<std::vector<int64_t>>()))
      fail(in({key("bytes")}), "tables-layout", "must be the bytes its shape and stride span");
    if (offset % kAlign || offset < end || static_cast<unsigned __int128>(offset) + bytes > spec["bytes"].get<uint64_t>())
      fail(in({key("offset")}), "tables-layout", "must be a multiple of " + std::to_string(kAlign) + ", after the tensor before it and inside the file");
    end = offset + bytes;
    unsigned __int128 covered = 0;
    const json& segments = t["segments"];
    for (size_t j = 0; j < segments.size(); ++j) {
      if (segments[j]["offset"].get<uint64_t>() != covered)
        fail(in({key("segments"), index(j), key("offset")}), "tables-layout",
             "must be " + to_string128(covered) + ", where the segment before it ends");
      covered += segments[j]["bytes"].get<uint64_t>();
    }
    if (covered != bytes) fail(in({key("segments")}), "tables-layout", "must cover its " + std::to_string(bytes) + " bytes exactly");
  }
}

void features(const json& m) {
  const json& features = m["sparse_features"];
  const bool weighted = m["weighted"].get<bool>();
  std::set<std::string> names;
  bool any_weighted = false;
  for (size_t i = 0; i < features.size(); ++i) {
    const json& f = features[i];
    const std::string& name = f["name"].get_ref<const std::string&>();
    if (!names.insert(name).second) fail(at({key("sparse_features"), index(i), key("name")}), "unique-feature", py_repr(name) + " appears twice");
    if (f.contains("id_bound") && f["id_bound"].get<uint64_t>() < f["rows"].get<uint64_t>())
      fail(at({key("sparse_features"), index(i), key("id_bound")}), "id-bound",
           "must be >= rows (" + f["rows"].dump() + "), got " + f["id_bound"].dump());
    any_weighted = any_weighted || f.value("weighted", weighted);
  }
  if (!features.empty() && weighted != any_weighted) fail(at({key("weighted")}), "weighted", "must say whether any sparse feature is weighted");
}

// The sample is one request of this model and its outputs: each tensor's dtype and shape follow from the manifest.
void sample(const json& m) {
  const json& sample = m["sample"];
  const json& inputs = sample["inputs"];
  const bool weighted = m["weighted"].get<bool>();
  if (weighted != inputs.contains("weights"))
    fail(at({key("sample"), key("inputs"), key("weights")}), "sample",
         weighted ? "is missing (the model is weighted)" : "is given, but the model is unweighted");
  const uint64_t b = sample["batch_size"].get<uint64_t>();
  auto need = [&](const char* group, const std::string& name, const char* dtype, const std::optional<std::vector<uint64_t>>& shape,
                  const char* what) {
    const json& spec = sample[group][name];
    const std::vector<uint64_t> got = sizes(spec["shape"]);
    if (spec["dtype"] != dtype || (shape ? got != *shape : got.size() != 1))
      fail(at({key("sample"), key(group), key(name)}), "sample",
           std::string("must be ") + dtype + " " + (shape ? py_list(*shape) : "[N]") + " (" + what + "), got " +
               spec["dtype"].get<std::string>() + " " + py_list(got));
  };
  need("inputs", "dense", "float32", std::vector<uint64_t>{b, m["num_dense"].get<uint64_t>()}, "batch_size, num_dense");
  need("inputs", "lengths", "int32", std::vector<uint64_t>{static_cast<uint64_t>(m["sparse_features"].size()) * b}, "features x batch_size");
  need("inputs", "values", "int64", std::nullopt, "one dimension");
  if (inputs.contains("weights")) need("inputs", "weights", "float32", sizes(inputs["values"]["shape"]), "one per value");
  std::vector<std::string> declared, recorded;
  for (const auto& [name, _] : m["outputs"].items()) declared.push_back(name);  // nlohmann keeps keys sorted: sorted()
  for (const auto& [name, _] : sample["outputs"].items()) recorded.push_back(name);
  if (declared != recorded)
    fail(at({key("sample"), key("outputs")}), "sample", "must hold every output, " + py_list(declared) + ", got " + py_list(recorded));
  for (const auto& name : recorded) {
    std::vector<uint64_t> shape{b};
    const json& dims = m["outputs"][name]["shape"];
    for (size_t d = 1; d < dims.size(); ++d) shape.push_back(dims[d].get<uint64_t>());
    need("outputs", name, "float32", shape, "batch_size, the output's shape");
  }
}

// Each feature's rows are those tables.bin holds of its table (rules.py _table_rows).
void table_rows(const json& m) {
  std::vector<std::tuple<std::string, std::string, uint64_t>> held;  // (tensor, table, rows) of each table segment, in file order
  for (const auto& t : m["tables"]["tensors"])
    for (const auto& seg : t["segments"])
      if (seg.contains("rows") && !seg["rows"].is_null())
        held.emplace_back(t["name"].get<std::string>(), tables::split_shard(seg["name"].get<std::string>()).first, seg["rows"].get<uint64_t>());
  const json& features = m["sparse_features"];
  for (size_t i = 0; i < features.size(); ++i) {
    const std::string& qualified = features[i]["table"].get_ref<const std::string&>();
    const auto [path, table] = tables::split_table_name(qualified);
    const std::string prefix = path.empty() ? "" : "model." + path + ".";
    const uint64_t rows = features[i]["rows"].get<uint64_t>();
    unsigned __int128 sum = 0;
    bool each = true, any = false;
    std::string listed;
    for (const auto& [tensor, name, r] : held) {
      if (name != table || tensor.compare(0, prefix.size(), prefix) != 0) continue;
      any = true;
      sum += r;
      each = each && r == rows;
      listed += (listed.empty() ? "" : "+") + std::to_string(r);
    }
    if (any && sum != rows && !each)
      fail(at({key("sparse_features"), index(i), key("rows")}), "table-rows",
           "is " + std::to_string(rows) + ", but tables holds " + listed + " rows of its table " + py_repr(qualified));
  }
}

void aoti(const json& m) {
  const json& aoti = m["aoti"];
  for (const auto& [name, span] : aoti["dynamic"].items())  // nlohmann keeps keys sorted: sorted()
    if (span[0].get<uint64_t>() > span[1].get<uint64_t>())
      fail(at({key("aoti"), key("dynamic"), key(name)}), "aoti-dynamic", "must be [min, max] sizes, got [" + span[0].dump() + ", " + span[1].dump() + "]");
  std::multiset<std::string> named, outputs;
  for (const auto& name : aoti["output_order"]) named.insert(name.get<std::string>());
  std::vector<std::string> declared;
  for (const auto& [name, _] : m["outputs"].items()) {
    outputs.insert(name);
    declared.push_back(name);
  }
  if (named != outputs) fail(at({key("aoti"), key("output_order")}), "aoti-outputs", "must name every output once, " + py_list(declared));
}

void inputs(const json& m) {
  const json want = derived_inputs(m["num_dense"], m["weighted"].get<bool>());
  if (m["inputs"] != want)
    fail(at({key("inputs")}), "inputs", "must be " + want.dump() + " (from num_dense and weighted), got " + m["inputs"].dump().substr(0, 200));
}

}  // namespace

std::vector<Problem> contract_problems(const json& m) {
  std::vector<Problem> found = schema::problems(m);
  if (!found.empty()) return found;
  try {  // the rules between fields, in rules.py's order, on a manifest the schema accepts
    if (m.contains("tables")) tables_layout(m["tables"]);
    features(m);
    sample(m);
    if (m.contains("tables")) table_rows(m);
    if (m.contains("aoti")) aoti(m);
    inputs(m);
  } catch (const Broken& broken) {
    return {broken.problem};
  }
  return {};
}

void check_manifest(const json& m, const std::string& file) {
  const std::vector<Problem> found = contract_problems(m);
  if (!found.empty())
    throw ArtifactError(file + ": " + found[0].message + (found.size() > 1 ? " (and " + std::to_string(found.size() - 1) + " more)" : ""));
}

}  // namespace recship
