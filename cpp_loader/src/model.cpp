// recship::Model: manifest, checksum, op libraries, TorchScript module, validation, predict.
#include "recship/model.h"

#include <dlfcn.h>
#include <openssl/evp.h>
#include <torch/script.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#ifndef RECSHIP_FBGEMM_DIR
#define RECSHIP_FBGEMM_DIR ""
#endif

namespace recship {
namespace {

using json = nlohmann::json;

std::string read_file(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ArtifactError(std::string(what) + " is missing: " + path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string sha256_hex(const std::string& data) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  if (EVP_Digest(data.data(), data.size(), digest, &n, EVP_sha256(), nullptr) != 1) throw Error("sha256 failed");
  std::ostringstream s;
  for (unsigned int i = 0; i < n; ++i) s << std::hex << std::setw(2) << std::setfill('0') << int(digest[i]);
  return s.str();
}

// "2.13.0+cpu" -> "2.13.0"
std::string release(const std::string& v) { return v.substr(0, v.find_first_of("+ ")); }

std::string fbgemm_version(const std::string& dir) {
  std::ifstream in(dir + "/version.py");
  std::string line;
  std::regex re("__version__\\s*(?::\\s*str)?\\s*=\\s*[\"']([^\"']+)[\"']");
  std::smatch m;
  while (std::getline(in, line))
    if (std::regex_search(line, m, re)) return m[1];
  return "";
}

template <typename T>
std::vector<T> read_raw(const std::string& path) {
  std::string bytes = read_file(path, "sample file");
  std::vector<T> out(bytes.size() / sizeof(T));
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(T));  // artifacts are little-endian, as is x86/arm
  return out;
}

// The fields of protos/recship/artifact/v1/manifest.schema.json's "required" lists, with their JSON
// types, so that a manifest missing one is refused naming it (not a json::type_error later on).
// tests/cpp_loader checks this against the schema: each required field, removed, must be named here.
void check_manifest(const json& m, const std::string& file) {
  enum class Kind { Object, Array, String, Integer, Boolean };
  auto need = [&file](const json& obj, const std::string& key, Kind kind, const std::string& where) -> const json& {
    static const char* names[] = {"an object", "an array", "a string", "an integer", "a boolean"};
    auto it = obj.find(key);
    if (it == obj.end()) throw ArtifactError(file + ": " + where + key + " is missing");
    bool ok = kind == Kind::Object    ? it->is_object()
              : kind == Kind::Array   ? it->is_array()
              : kind == Kind::String  ? it->is_string()
              : kind == Kind::Integer ? it->is_number_integer()
                                      : it->is_boolean();
    if (!ok) throw ArtifactError(file + ": " + where + key + " must be " + names[static_cast<int>(kind)]);
    return *it;
  };
  if (!m.is_object()) throw ArtifactError(file + ": must be a JSON object");
  if (need(m, "format", Kind::String, "") != "recship.artifact/1")
    throw ArtifactError(file + ": unknown artifact format '" + m["format"].get<std::string>() + "'");
  need(m, "model_sha256", Kind::String, "");
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
  }
  for (const auto& [name, out] : need(m, "outputs", Kind::Object, "").items()) {
    const std::string where = "outputs['" + name + "'].";
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
  for (const auto& lib : need(m, "op_libraries", Kind::Array, ""))
    if (!lib.is_string()) throw ArtifactError(file + ": op_libraries must hold file names");
  need(m, "quantization", Kind::Object, "");
  need(m, "validation", Kind::Object, "");
  const json& sample = need(m, "sample", Kind::Object, "");
  need(sample, "batch_size", Kind::Integer, "sample.");
  for (const char* group : {"inputs", "outputs"}) {
    const json& tensors = need(sample, group, Kind::Object, "sample.");
    for (const auto& [name, spec] : tensors.items()) {
      const std::string where = std::string("sample.") + group + "['" + name + "'].";
      if (!spec.is_object()) throw ArtifactError(file + ": " + where.substr(0, where.size() - 1) + " must be an object");
      need(spec, "file", Kind::String, where);
      need(spec, "dtype", Kind::String, where);
      need(spec, "shape", Kind::Array, where);
    }
    if (std::string(group) == "inputs")
      for (const char* key : {"dense", "lengths", "values"})
        if (!tensors.contains(key)) throw ArtifactError(file + ": sample.inputs['" + key + "'] is missing");
  }
}

}  // namespace

struct Model::Impl {
  std::string dir;
  json manifest;
  mutable torch::jit::Module module;
  std::vector<std::string> features;
  std::map<std::string, int64_t> rows;
  std::map<std::string, bool> modulo;
  bool weighted = false;                      // any feature takes weights: the model gets a weights tensor
  std::map<std::string, bool> feature_weighted;  // which features take them (ids of the others get weight 1)
  int64_t num_dense = 0;
  int64_t max_batch_size = 512;

  std::vector<torch::jit::IValue> inputs(const Request& r) const;
};

Model::Model() : impl_(std::make_unique<Impl>()) {}
Model::~Model() = default;

std::unique_ptr<Model> Model::load(const std::string& artifact_dir, const LoadOptions& options) {
  std::unique_ptr<Model> model(new Model());
  Impl& m = *model->impl_;
  m.dir = artifact_dir;
  if (options.max_batch_size < 1) throw Error("LoadOptions::max_batch_size must be >= 1");
  m.max_batch_size = options.max_batch_size;
  try {
    m.manifest = json::parse(read_file(artifact_dir + "/manifest.json", "manifest.json"));
  } catch (const json::exception& e) {
    throw ArtifactError(artifact_dir + "/manifest.json is not valid JSON: " + e.what());
  }
  check_manifest(m.manifest, artifact_dir + "/manifest.json");
  std::string model_bytes = read_file(artifact_dir + "/model.pt", "model.pt");
  std::string digest = sha256_hex(model_bytes);
  if (digest != m.manifest["model_sha256"].get<std::string>())
    throw ArtifactError(artifact_dir + "/model.pt: sha256 " + digest + " does not match the manifest's " +
                        m.manifest["model_sha256"].get<std::string>());

  std::string fbgemm_dir = options.fbgemm_dir.empty() ? RECSHIP_FBGEMM_DIR : options.fbgemm_dir;
  if (options.check_versions) {
    std::string built_torch = release(m.manifest["versions"]["torch"].get<std::string>());
    std::string running_torch = release(TORCH_VERSION);
    if (built_torch != running_torch)
      throw VersionMismatch("artifact built with torch " + built_torch + ", this binary runs torch " + running_torch);
    std::string built_fbgemm = m.manifest["versions"]["fbgemm_gpu"].get<std::string>();
    std::string found = fbgemm_version(fbgemm_dir);
    if (!found.empty() && release(found) != release(built_fbgemm))
      throw VersionMismatch("artifact built with fbgemm_gpu " + built_fbgemm + ", " + fbgemm_dir + " holds " + found);
  }
  for (const auto& lib : m.manifest["op_libraries"]) {
    std::string path = fbgemm_dir + "/" + lib.get<std::string>();
    if (!dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL)) {
      const char* err = dlerror();
      throw MissingLibrary("cannot load fbgemm op library " + path + ": " + (err ? err : "unknown error"));
    }
  }
  try {
    std::istringstream stream(model_bytes);
    m.module = torch::jit::load(stream, torch::kCPU);
    m.module.eval();
  } catch (const c10::Error& e) {
    throw ArtifactError(artifact_dir + "/model.pt cannot be loaded: " + e.what_without_backtrace());
  }
  for (const auto& f : m.manifest["sparse_features"]) {
    std::string name = f["name"];
    m.features.push_back(name);
    m.rows[name] = f["rows"].get<int64_t>();
    m.modulo[name] = f["id_policy"].get<std::string>() == "modulo";
  }
  m.weighted = m.manifest["weighted"].get<bool>();
  for (const auto& f : m.manifest["sparse_features"])
    m.feature_weighted[f["name"].get<std::string>()] = f.value("weighted", m.weighted);
  m.num_dense = m.manifest["num_dense"].get<int64_t>();
  if (options.self_check) {
    auto got = model->predict(model->sample_request());
    auto want = model->sample_outputs();
    for (const auto& [name, out] : want) {
      auto it = got.find(name);
      if (it == got.end()) throw ArtifactError(artifact_dir + ": the model does not produce output '" + name + "'");
      for (size_t i = 0; i < out.values.size(); ++i)
        if (std::fabs(it->second.values[i] - out.values[i]) > 1e-5f)
          throw ArtifactError(artifact_dir + ": sample self-check failed on output '" + name + "'");
    }
  }
  return model;
}

// Validation: the same rules and messages as the gRPC server (recship/serving/requests.py).
std::vector<torch::jit::IValue> Model::Impl::inputs(const Request& r) const {
  const int64_t b = r.batch_size;
  if (b <= 0) throw InvalidRequest("batch_size must be > 0, got " + std::to_string(b));
  if (b > max_batch_size)
    throw InvalidRequest("batch_size " + std::to_string(b) + " exceeds the model's limit of " + std::to_string(max_batch_size));
  for (const auto& [name, f] : r.sparse) {
    if (!rows.count(name)) {
      std::string list;  // formatted like Python's list repr, as the server prints it
      for (size_t i = 0; i < features.size(); ++i) list += (i ? ", '" : "'") + features[i] + "'";
      throw InvalidRequest("unknown sparse feature '" + name + "'; the model takes [" + list + "]");
    }
  }
  std::vector<std::string> missing;
  for (const auto& name : features)
    if (!r.sparse.count(name)) missing.push_back("'" + name + "'");
  if (!missing.empty()) {
    std::string list;
    for (size_t i = 0; i < missing.size(); ++i) list += (i ? ", " : "") + missing[i];
    throw InvalidRequest("missing sparse features [" + list + "]");
  }
  int64_t total = 0;
  for (const auto& name : features) total += static_cast<int64_t>(r.sparse.at(name).ids.size());
  auto lengths = torch::empty({static_cast<int64_t>(features.size()) * b}, torch::kInt32);
  auto values = torch::empty({total}, torch::kInt64);
  auto weights = torch::empty({weighted ? total : 0}, torch::kFloat32);
  int32_t* lp = lengths.data_ptr<int32_t>();
  int64_t* vp = values.data_ptr<int64_t>();
  float* wp = weights.data_ptr<float>();
  for (const auto& name : features) {
    const Feature& f = r.sparse.at(name);
    const std::string where = "sparse feature '" + name + "': ";
    if (static_cast<int64_t>(f.lengths.size()) != b)
      throw InvalidRequest(where + std::to_string(f.lengths.size()) + " lengths for batch_size " + std::to_string(b));
    int64_t sum = 0;
    for (int32_t n : f.lengths) {
      if (n < 0) throw InvalidRequest(where + "negative length " + std::to_string(n));
      sum += n;
    }
    if (sum != static_cast<int64_t>(f.ids.size()))
      throw InvalidRequest(where + "sum(lengths) = " + std::to_string(sum) + " but " + std::to_string(f.ids.size()) + " ids");
    const int64_t limit = rows.at(name);
    const bool hash = modulo.at(name);
    for (int64_t id : f.ids) {
      if (hash) {
        *vp++ = ((id % limit) + limit) % limit;
      } else {
        if (id < 0 || id >= limit)
          // the wording of recship.sparse.ids.out_of_range_message, as every Python check says it
          throw InvalidRequest("feature '" + name + "': id " + std::to_string(id) + " is out of range [0, " + std::to_string(limit) + ")");
        *vp++ = id;
      }
    }
    if (feature_weighted.at(name)) {
      if (f.weights.size() != f.ids.size())
        throw InvalidRequest(where + std::to_string(f.weights.size()) + " weights for " + std::to_string(f.ids.size()) + " ids");
      for (float w : f.weights) {
        if (!std::isfinite(w)) throw InvalidRequest(where + "weights must be finite");
        *wp++ = w;
      }
    } else if (!f.weights.empty()) {
      throw InvalidRequest(where + "weights given, but " + (weighted ? "this feature is" : "the model's features are") + " unweighted");
    } else if (weighted) {
      wp = std::fill_n(wp, f.ids.size(), 1.0f);  // the model ignores them: this feature's collection is unweighted
    }
    std::copy(f.lengths.begin(), f.lengths.end(), lp);
    lp += b;
  }
  torch::Tensor dense;
  if (num_dense == 0 && r.dense.empty() && r.dense_rows == 0 && r.dense_cols == 0) {
    dense = torch::zeros({b, 0});
  } else {
    if (r.dense_rows != b || r.dense_cols != num_dense)
      throw InvalidRequest("dense shape [" + std::to_string(r.dense_rows) + ", " + std::to_string(r.dense_cols) +
                           "] does not match [batch_size, " + std::to_string(num_dense) + "] = [" + std::to_string(b) +
                           ", " + std::to_string(num_dense) + "]");
    if (static_cast<int64_t>(r.dense.size()) != b * num_dense)
      throw InvalidRequest("dense has " + std::to_string(r.dense.size()) + " values for shape [" + std::to_string(b) + ", " +
                           std::to_string(num_dense) + "]");
    for (float x : r.dense)
      if (!std::isfinite(x)) throw InvalidRequest("dense values must be finite (no NaN or infinity)");
    dense = torch::from_blob(const_cast<float*>(r.dense.data()), {b, num_dense}, torch::kFloat32).clone();
  }
  std::vector<torch::jit::IValue> args{dense, lengths, values};
  args.emplace_back(weighted ? torch::jit::IValue(weights) : torch::jit::IValue());
  return args;
}

std::map<std::string, Output> Model::predict(const Request& request) const {
  auto args = impl_->inputs(request);
  c10::InferenceMode guard;
  torch::jit::IValue result;
  try {
    result = impl_->module.forward(args);
  } catch (const c10::Error& e) {
    throw Error(std::string("the model failed: ") + e.what_without_backtrace());
  }
  std::map<std::string, Output> out;
  for (const auto& item : result.toGenericDict()) {
    torch::Tensor t = item.value().toTensor().to(torch::kFloat32).contiguous();
    Output o;
    o.shape.assign(t.sizes().begin(), t.sizes().end());
    o.values.assign(t.data_ptr<float>(), t.data_ptr<float>() + t.numel());
    out[item.key().toStringRef()] = std::move(o);
  }
  return out;
}

double Model::forward_ms(const Request& request, int runs) const {
  auto args = impl_->inputs(request);
  c10::InferenceMode guard;
  std::vector<double> ms;
  for (int i = 0; i < runs; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    impl_->module.forward(args);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms.empty() ? 0.0 : ms[ms.size() / 2];
}

const std::vector<std::string>& Model::feature_names() const { return impl_->features; }
int64_t Model::num_dense() const { return impl_->num_dense; }

Request Model::sample_request() const {
  const json& s = impl_->manifest["sample"]["inputs"];
  auto lengths = read_raw<int32_t>(impl_->dir + "/" + s["lengths"]["file"].get<std::string>());
  auto values = read_raw<int64_t>(impl_->dir + "/" + s["values"]["file"].get<std::string>());
  std::vector<float> weights;
  if (s.contains("weights")) weights = read_raw<float>(impl_->dir + "/" + s["weights"]["file"].get<std::string>());
  Request r;
  r.batch_size = impl_->manifest["sample"]["batch_size"].get<int64_t>();
  size_t l = 0, v = 0;
  for (const auto& name : impl_->features) {
    Feature f;
    f.lengths.assign(lengths.begin() + l, lengths.begin() + l + r.batch_size);
    l += r.batch_size;
    int64_t n = 0;
    for (int32_t x : f.lengths) n += x;
    f.ids.assign(values.begin() + v, values.begin() + v + n);
    if (!weights.empty() && impl_->feature_weighted.at(name)) f.weights.assign(weights.begin() + v, weights.begin() + v + n);
    v += n;
    r.sparse[name] = std::move(f);
  }
  r.dense = read_raw<float>(impl_->dir + "/" + s["dense"]["file"].get<std::string>());
  r.dense_rows = r.batch_size;
  r.dense_cols = impl_->num_dense;
  if (impl_->num_dense == 0) r.dense_rows = r.dense_cols = 0;
  return r;
}

std::map<std::string, Output> Model::sample_outputs() const {
  std::map<std::string, Output> out;
  for (const auto& [name, spec] : impl_->manifest["sample"]["outputs"].items()) {
    Output o;
    o.shape = spec["shape"].get<std::vector<int64_t>>();
    o.values = read_raw<float>(impl_->dir + "/" + spec["file"].get<std::string>());
    out[name] = std::move(o);
  }
  return out;
}

}  // namespace recship
