// The manifest checked (manifest.h): export/manifest.py check_manifest's rules and words.
#include "manifest.h"

#include <regex>
#include <set>
#include <tuple>

#include "recship/model.h"

namespace recship {

using json = nlohmann::json;

const std::string kFormat = "recship.artifact/2";    // the tables in tables.bin (export/tables.py)
const std::string kFormatV1 = "recship.artifact/1";  // the tables inside model.pt / model.pt2: still loaded

namespace {

// The Python type json.loads gives a JSON value (export/manifest.py's messages name them).
const char* python_type(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "NoneType";
    case json::value_t::boolean: return "bool";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return "int";
    case json::value_t::number_float: return "float";
    case json::value_t::string: return "str";
    case json::value_t::array: return "list";
    default: return "dict";
  }
}

// A JSON integer >= 0 (check_manifest's sizes()).
bool size_value(const json& v) { return v.is_number_integer() && (v.is_number_unsigned() || v.get<int64_t>() >= 0); }

// The rules of export/manifest.py check_manifest beyond the fields' JSON types (check_manifest has checked those),
// with its words: values in range, names unique, the sample's tensors those of one request of this model, and
// each feature's rows those tables.bin holds of its table.
void check_values(const json& m, const std::string& file) {
  auto fail = [&file](const std::string& what) { throw ArtifactError(file + ": " + what); };
  static const std::regex hex64("[0-9a-f]{64}");
  // model.pt's checksum; an artifact without model.pt (TorchScript could not compile the model) has model.pt2's (aoti)
  if (m.contains("model_sha256") && !std::regex_match(m["model_sha256"].get_ref<const std::string&>(), hex64))
    fail("model_sha256 must be 64 lowercase hex digits");
  if (m.contains("row_block") && !size_value(m["row_block"])) fail("row_block must be >= 0");
  const json& features = m["sparse_features"];
  const bool weighted = m["weighted"].get<bool>();
  std::set<std::string> names;
  bool any_weighted = false;
  for (size_t i = 0; i < features.size(); ++i) {
    const json& f = features[i];
    const std::string where = "sparse_features[" + std::to_string(i) + "].";
    auto positive = [](const json& v) { return v.is_number_unsigned() ? v.get<uint64_t>() > 0 : v.get<int64_t>() > 0; };
    if (!positive(f["rows"]) || !positive(f["dim"])) fail(where + "rows and dim must be positive");
    const std::string& policy = f["id_policy"].get_ref<const std::string&>();
    if (policy != "reject" && policy != "modulo") fail(where + "id_policy must be 'reject' or 'modulo'");
    if (f.contains("id_bound")) {  // rows <= id_bound <= kMaxIdBound, for a "reject" feature only
      const json& bound = f["id_bound"];
      const bool in_range = bound.is_number_unsigned() && f["rows"].is_number_unsigned() &&
                            bound.get<uint64_t>() >= f["rows"].get<uint64_t>() && bound.get<uint64_t>() <= kMaxIdBound;
      if (!in_range)
        fail(where + "id_bound must lie in [rows, 2**63 - 1] = [" + f["rows"].dump() + ", " + std::to_string(kMaxIdBound) + "], got " +
             bound.dump());
      if (policy != "reject") fail(where + "id_bound needs id_policy 'reject', got " + tables::py_repr(policy));
    }
    const std::string& name = f["name"].get_ref<const std::string&>();
    if (!names.insert(name).second) fail("sparse feature " + tables::py_repr(name) + " appears twice");
    any_weighted = any_weighted || f.value("weighted", weighted);
  }
  if (!size_value(m["num_dense"])) fail("num_dense must be >= 0");
  if (!features.empty() && weighted != any_weighted) fail("weighted must say whether any sparse feature is weighted");
  for (const auto& [name, out] : m["outputs"].items()) {
    const json& shape = out["shape"];
    bool ok = !shape.empty() && shape[0] == "B";
    for (size_t d = 1; ok && d < shape.size(); ++d) ok = size_value(shape[d]);
    if (!ok) fail("outputs[" + tables::py_repr(name) + "].shape must be ['B', n, ...], got " + shape.dump().substr(0, 80));
    if (out["dtype"] != "float32") fail("outputs[" + tables::py_repr(name) + "].dtype must be 'float32'");
  }
  const json& sharding = m["sharding"];
  if (sharding["device"] != "cpu" && sharding["device"] != "cuda") fail("sharding.device must be 'cpu' or 'cuda'");
  auto at_least_one = [](const json& v) { return v.is_number_unsigned() ? v.get<uint64_t>() >= 1 : v.get<int64_t>() >= 1; };
  if (!at_least_one(sharding["num_devices"]) || !at_least_one(sharding["row_alignment"]))
    fail("sharding.num_devices and sharding.row_alignment must be >= 1");
  for (size_t i = 0; i < sharding["shards"].size(); ++i)
    for (const char* key : {"index", "device", "row_offset", "rows", "col_offset", "cols"})
      if (!size_value(sharding["shards"][i][key])) fail("sharding.shards[" + std::to_string(i) + "]." + key + " must be >= 0");
  const json& sample = m["sample"];
  if (!at_least_one(sample["batch_size"])) fail("sample.batch_size must be >= 1");
  for (const char* group : {"inputs", "outputs"}) {
    for (const auto& [name, spec] : sample[group].items()) {
      const std::string where = std::string("sample.") + group + "[" + tables::py_repr(name) + "].";
      const std::string& path = spec["file"].get_ref<const std::string&>();
      size_t parts = 0;
      bool up = false;  // PurePosixPath(file).parts: "" and "." components do not count
      for (size_t start = 0; start <= path.size();) {
        size_t slash = path.find('/', start);
        if (slash == std::string::npos) slash = path.size();
        const std::string part = path.substr(start, slash - start);
        if (!part.empty() && part != ".") ++parts;
        up = up || part == "..";
        start = slash + 1;
      }
      if (parts == 0 || path[0] == '/' || up || path.find('\\') != std::string::npos)
        fail(where + "file must be a relative path inside the artifact, got " + tables::py_repr(path.substr(0, 80)));
      const json& dtype = spec["dtype"];
      if (dtype != "float32" && dtype != "int32" && dtype != "int64") fail(where + "dtype must be one of ['float32', 'int32', 'int64']");
      for (const auto& d : spec["shape"])
        if (!size_value(d)) fail(where + "shape must be a list of sizes");
    }
  }
  // the sample is one request of this model and its outputs (export/manifest.py _check_sample_spec)
  const json& inputs = sample["inputs"];
  std::vector<std::string> unknown;
  for (const auto& [name, _] : inputs.items())
    if (name != "dense" && name != "lengths" && name != "values" && name != "weights") unknown.push_back(name);
  if (!unknown.empty()) fail("sample.inputs has unknown inputs " + py_list(unknown));
  if (weighted != inputs.contains("weights"))
    fail(weighted ? "sample.inputs['weights'] is missing (the model is weighted)" : "sample.inputs['weights'] is given, but the model is unweighted");
  auto shape_of = [](const json& spec) {
    std::vector<uint64_t> out;
    for (const auto& d : spec["shape"]) out.push_back(d.get<uint64_t>());
    return out;
  };
  const uint64_t b = sample["batch_size"].get<uint64_t>();
  auto need = [&](const char* group, const std::string& name, const char* dtype, const std::optional<std::vector<uint64_t>>& shape,
                  const char* what) {
    const json& spec = sample[group][name];
    const std::vector<uint64_t> got = shape_of(spec);
    if (spec["dtype"] != dtype || (shape ? got != *shape : got.size() != 1))
      fail(std::string("sample.") + group + "[" + tables::py_repr(name) + "] must be " + dtype + " " + (shape ? py_list(*shape) : "[N]") +
           " (" + what + "), got " + spec["dtype"].get<std::string>() + " " + py_list(got));
  };
  need("inputs", "dense", "float32", std::vector<uint64_t>{b, m["num_dense"].get<uint64_t>()}, "batch_size, num_dense");
  need("inputs", "lengths", "int32", std::vector<uint64_t>{static_cast<uint64_t>(features.size()) * b}, "features x batch_size");
  need("inputs", "values", "int64", std::nullopt, "one dimension");
  if (inputs.contains("weights")) need("inputs", "weights", "float32", shape_of(inputs["values"]), "one per value");
  std::vector<std::string> declared, recorded;
  for (const auto& [name, _] : m["outputs"].items()) declared.push_back(name);  // nlohmann keeps keys sorted: sorted()
  for (const auto& [name, _] : sample["outputs"].items()) recorded.push_back(name);
  if (declared != recorded) fail("sample.outputs must hold every output, " + py_list(declared) + ", got " + py_list(recorded));
  for (const auto& name : recorded) {
    std::vector<uint64_t> shape{b};
    const json& dims = m["outputs"][name]["shape"];
    for (size_t d = 1; d < dims.size(); ++d) shape.push_back(dims[d].get<uint64_t>());
    need("outputs", name, "float32", shape, "batch_size, the output's shape");
  }
  // each feature's rows: all of its table's segment rows (row-wise) or each of them (export/manifest.py _check_table_rows);
  // a segment "<table>" or "<table>@<shard>" of a tensor "model.<path>." holds rows of the feature table "<path>.<table>"
  std::vector<std::tuple<std::string, std::string, uint64_t>> held;  // (tensor, table, rows) of each segment, in file order
  static const std::regex shard_index("[0-9]+");
  for (const auto& t : m.value("tables", json::object()).value("tensors", json::array())) {
    for (const auto& seg : t["segments"]) {
      if (!seg.contains("rows") || seg["rows"].is_null()) continue;
      std::string name = seg["name"].get<std::string>();
      const size_t at = name.rfind('@');
      if (at != std::string::npos && std::regex_match(name.substr(at + 1), shard_index)) name = name.substr(0, at);
      held.emplace_back(t["name"].get<std::string>(), name, seg["rows"].get<uint64_t>());
    }
  }
  for (size_t i = 0; i < features.size(); ++i) {
    const std::string& qualified = features[i]["table"].get_ref<const std::string&>();
    const size_t dot = qualified.rfind('.');
    const std::string table = dot == std::string::npos ? qualified : qualified.substr(dot + 1);
    const std::string prefix = dot == std::string::npos ? "" : "model." + qualified.substr(0, dot) + ".";
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
      fail("sparse_features[" + std::to_string(i) + "].rows is " + std::to_string(rows) + ", but tables holds " + listed +
           " rows of its table " + tables::py_repr(qualified));
  }
  if (m.contains("aoti")) {
    const json& aoti = m["aoti"];
    if (!std::regex_match(aoti["sha256"].get_ref<const std::string&>(), hex64)) fail("aoti.sha256 must be 64 lowercase hex digits");
    for (const auto& [key, span] : aoti["dynamic"].items())
      if (!span.is_array() || span.size() != 2 || !size_value(span[0]) || !size_value(span[1]) ||
          span[0].get<uint64_t>() > span[1].get<uint64_t>())
        fail("aoti.dynamic[" + tables::py_repr(key) + "] must be [min, max] sizes");
    json want = {"dense", "lengths", "values"};
    if (weighted) want.push_back("weights");
    if (aoti["input_order"] != want) fail("aoti.input_order must be " + want.dump() + ", got " + aoti["input_order"].dump());
    std::multiset<std::string> named, outputs;
    for (const auto& name : aoti["output_order"]) {
      if (!name.is_string()) fail("aoti.output_order must name every output once");
      named.insert(name.get<std::string>());
    }
    for (const auto& [name, _] : m["outputs"].items()) outputs.insert(name);
    if (named != outputs) fail("aoti.output_order must name every output once");
    std::vector<std::string> unknown_fields;
    for (const auto& [key, _] : aoti.items())
      if (key != "file" && key != "sha256" && key != "target_isa" && key != "torch" && key != "dynamic" && key != "input_order" &&
          key != "output_order" && key != "compile_seconds")
        unknown_fields.push_back(key);
    if (!unknown_fields.empty()) fail("aoti has unknown fields " + py_list(unknown_fields));
  }
  // the inputs, as num_dense and weighted make them (Manifest.from_dict)
  const json derived = {
      {"dense", {{"dtype", "float32"}, {"shape", {"B", m["num_dense"]}}}},
      {"lengths", {{"dtype", "int32"}, {"shape", {"F*B"}}, {"order", "feature-major, features in the order below"}}},
      {"values", {{"dtype", "int64"}, {"shape", {"N"}}}},
      {"weights", {{"dtype", "float32"}, {"shape", {"N"}}, {"required", weighted}}},
  };
  if (m["inputs"] != derived)
    fail("inputs must be " + derived.dump() + " (from num_dense and weighted), got " + m["inputs"].dump().substr(0, 200));
}

// The fields of protos/recship/artifact/v1/manifest.schema.json's "required" lists, with their JSON
// types, so that a manifest missing one is refused naming it (not a json::type_error later on).
// tests/cpp_loader checks this against the schema: each required field, removed, must be named here.
}  // namespace

void check_manifest(const json& m, const std::string& file) {
  enum class Kind { Object, Array, String, Integer, Boolean, Number };
  auto need = [&file](const json& obj, const std::string& key, Kind kind, const std::string& where) -> const json& {
    // Python's names of the types (export/manifest.py's words: "num_dense must be int, got str")
    static const char* names[] = {"dict", "list", "str", "int", "bool", "a number"};
    auto it = obj.find(key);
    if (it == obj.end()) throw ArtifactError(file + ": " + where + key + " is missing");
    bool ok = kind == Kind::Object    ? it->is_object()
              : kind == Kind::Array   ? it->is_array()
              : kind == Kind::String  ? it->is_string()
              : kind == Kind::Integer ? it->is_number_integer()
              : kind == Kind::Number  ? it->is_number()
                                      : it->is_boolean();
    if (!ok && kind == Kind::Number) throw ArtifactError(file + ": " + where + key + " must be a number");
    if (!ok) throw ArtifactError(file + ": " + where + key + " must be " + names[static_cast<int>(kind)] + ", got " + python_type(*it));
    return *it;
  };
  if (!m.is_object()) throw ArtifactError(file + ": must be a JSON object");
  const std::string& format = need(m, "format", Kind::String, "").get_ref<const std::string&>();
  if (format != kFormat && format != kFormatV1)
    throw ArtifactError(file + ": unknown artifact format " + tables::py_repr(format.substr(0, 80)) + ", expected '" + kFormat + "'");
  if (format == kFormat) {  // the tables live in tables.bin (export/tables.py check_spec's rules)
    need(m, "tables", Kind::Object, "");
    tables::parse_spec(m["tables"], file);
  } else if (m.contains("tables")) {
    throw ArtifactError(file + ": tables needs format '" + kFormat + "'");
  }
  if (m.contains("model_sha256") || !m.contains("aoti")) need(m, "model_sha256", Kind::String, "");
  if (m.contains("row_block")) need(m, "row_block", Kind::Integer, "");
  const json& model = need(m, "model", Kind::Object, "");
  need(model, "name", Kind::String, "model.");
  need(model, "version", Kind::Integer, "model.");
  need(model, "kind", Kind::String, "model.");
  const json& inputs = need(m, "inputs", Kind::Object, "");
  for (const char* key : {"dense", "lengths", "values", "weights"}) need(inputs, key, Kind::Object, "inputs.");
  need(m, "num_dense", Kind::Integer, "");
  need(m, "weighted", Kind::Boolean, "");
  const json& features = need(m, "sparse_features", Kind::Array, "");
  for (size_t i = 0; i < features.size(); ++i) {
    const std::string where = "sparse_features[" + std::to_string(i) + "].";
    if (!features[i].is_object()) throw ArtifactError(file + ": " + where.substr(0, where.size() - 1) + " must be an object");
    for (const char* key : {"name", "table", "pooling", "weight_type", "id_policy"}) need(features[i], key, Kind::String, where);
    for (const char* key : {"dim", "rows"}) need(features[i], key, Kind::Integer, where);
    if (features[i].contains("weighted")) need(features[i], "weighted", Kind::Boolean, where);
    if (features[i].contains("id_bound")) need(features[i], "id_bound", Kind::Integer, where);
  }
  for (const auto& [name, out] : need(m, "outputs", Kind::Object, "").items()) {
    const std::string where = "outputs[" + tables::py_repr(name) + "].";
    if (!out.is_object()) throw ArtifactError(file + ": " + where.substr(0, where.size() - 1) + " must be an object");
    need(out, "dtype", Kind::String, where);
    need(out, "shape", Kind::Array, where);
  }
  const json& sharding = need(m, "sharding", Kind::Object, "");
  need(sharding, "device", Kind::String, "sharding.");
  need(sharding, "num_devices", Kind::Integer, "sharding.");
  need(sharding, "row_alignment", Kind::Integer, "sharding.");
  const json& shards = need(sharding, "shards", Kind::Array, "sharding.");
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string where = "sharding.shards[" + std::to_string(i) + "].";
    if (!shards[i].is_object()) throw ArtifactError(file + ": " + where.substr(0, where.size() - 1) + " must be an object");
    need(shards[i], "table", Kind::String, where);
    for (const char* key : {"index", "device", "row_offset", "rows", "col_offset", "cols"}) need(shards[i], key, Kind::Integer, where);
  }
  const json& versions = need(m, "versions", Kind::Object, "");
  for (const char* key : {"torch", "fbgemm_gpu", "python"}) need(versions, key, Kind::String, "versions.");
  for (const auto& lib : need(m, "op_libraries", Kind::Array, ""))  // plain file names: dlopen'ed from fbgemm_gpu's folder
    if (!lib.is_string() || lib == "" || lib == "." || lib == ".." || lib.get<std::string>().find_first_of("/\\") != std::string::npos)
      throw ArtifactError(file + ": op_libraries must be a list of file names");
  need(m, "quantization", Kind::Object, "");
  need(m, "validation", Kind::Object, "");
  const json& sample = need(m, "sample", Kind::Object, "");
  need(sample, "batch_size", Kind::Integer, "sample.");
  for (const char* group : {"inputs", "outputs"}) {
    const json& tensors = need(sample, group, Kind::Object, "sample.");
    for (const auto& [name, spec] : tensors.items()) {
      const std::string where = std::string("sample.") + group + "[" + tables::py_repr(name) + "].";
      if (!spec.is_object()) throw ArtifactError(file + ": " + where.substr(0, where.size() - 1) + " must be an object");
      need(spec, "file", Kind::String, where);
      need(spec, "dtype", Kind::String, where);
      need(spec, "shape", Kind::Array, where);
    }
    if (std::string(group) == "inputs")
      for (const char* key : {"dense", "lengths", "values"})
        if (!tensors.contains(key)) throw ArtifactError(file + ": sample.inputs['" + key + "'] is missing");
  }
  if (m.contains("aoti")) {  // optional: the AOTInductor package (export/manifest.py AotiSpec)
    const json& aoti = need(m, "aoti", Kind::Object, "");
    if (need(aoti, "file", Kind::String, "aoti.") != "model.pt2") throw ArtifactError(file + ": aoti.file must be 'model.pt2'");
    for (const char* key : {"sha256", "target_isa", "torch"}) need(aoti, key, Kind::String, "aoti.");
    need(aoti, "dynamic", Kind::Object, "aoti.");
    need(aoti, "input_order", Kind::Array, "aoti.");
    need(aoti, "output_order", Kind::Array, "aoti.");
    need(aoti, "compile_seconds", Kind::Number, "aoti.");
  }
  check_values(m, file);  // the values, as export/manifest.py checks them once their types are right
}

}  // namespace recship
