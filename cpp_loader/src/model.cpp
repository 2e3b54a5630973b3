// recship::Model: manifest, checksum, op libraries, TorchScript module or AOTInductor package, validation, predict.
#include "recship/model.h"

#include <dlfcn.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <ATen/Parallel.h>
#include <caffe2/serialize/read_adapter_interface.h>
#include <torch/script.h>
#include <torch/version.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "tables.h"

#ifndef RECSHIP_FBGEMM_DIR
#define RECSHIP_FBGEMM_DIR ""
#endif
// The full version of the torch this library links ("2.13.0+cpu"), read from it at configure time: a
// model.pt2 only runs under the torch build that compiled it. TORCH_VERSION has the release alone.
#ifndef RECSHIP_TORCH_VERSION
#define RECSHIP_TORCH_VERSION ""
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

std::string sha256_hex(const std::string& data) { return tables::sha256_hex(data.data(), data.size()); }

// The verified bytes of a model file as torch::jit::load's input, without the copy an istringstream makes.
class BytesAdapter : public caffe2::serialize::ReadAdapterInterface {
 public:
  explicit BytesAdapter(const std::string& bytes) : bytes_(bytes) {}
  size_t size() const override { return bytes_.size(); }
  size_t read(uint64_t pos, void* buf, size_t n, const char* what = "") const override {
    (void)what;
    if (pos >= bytes_.size()) return 0;
    n = std::min<size_t>(n, bytes_.size() - pos);
    std::memcpy(buf, bytes_.data() + pos, n);
    return n;
  }

 private:
  const std::string& bytes_;
};

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

const std::string kFormat = "recship.artifact/2";    // the tables in tables.bin (export/tables.py)
const std::string kFormatV1 = "recship.artifact/1";  // the tables inside model.pt / model.pt2: still loaded
const std::string kPinnedName = "recship/tables.json";  // model.pt's extra file, model.pt2's <root>/extra/ entry

// The fields of protos/recship/artifact/v1/manifest.schema.json's "required" lists, with their JSON
// types, so that a manifest missing one is refused naming it (not a json::type_error later on).
// tests/cpp_loader checks this against the schema: each required field, removed, must be named here.
void check_manifest(const json& m, const std::string& file) {
  enum class Kind { Object, Array, String, Integer, Boolean, Number };
  auto need = [&file](const json& obj, const std::string& key, Kind kind, const std::string& where) -> const json& {
    static const char* names[] = {"an object", "an array", "a string", "an integer", "a boolean", "a number"};
    auto it = obj.find(key);
    if (it == obj.end()) throw ArtifactError(file + ": " + where + key + " is missing");
    bool ok = kind == Kind::Object    ? it->is_object()
              : kind == Kind::Array   ? it->is_array()
              : kind == Kind::String  ? it->is_string()
              : kind == Kind::Integer ? it->is_number_integer()
              : kind == Kind::Number  ? it->is_number()
                                      : it->is_boolean();
    if (!ok) throw ArtifactError(file + ": " + where + key + " must be " + names[static_cast<int>(kind)]);
    return *it;
  };
  if (!m.is_object()) throw ArtifactError(file + ": must be a JSON object");
  const std::string& format = need(m, "format", Kind::String, "").get_ref<const std::string&>();
  if (format != kFormat && format != kFormatV1)
    throw ArtifactError(file + ": unknown artifact format '" + format + "', expected '" + kFormat + "'");
  if (format == kFormat) {  // the tables live in tables.bin (export/tables.py check_spec's rules)
    need(m, "tables", Kind::Object, "");
    tables::parse_spec(m["tables"], file);
  } else if (m.contains("tables")) {
    throw ArtifactError(file + ": tables needs format '" + kFormat + "'");
  }
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
  if (m.contains("aoti")) {  // optional: the AOTInductor package (export/artifact.py AotiSpec)
    const json& aoti = need(m, "aoti", Kind::Object, "");
    if (need(aoti, "file", Kind::String, "aoti.") != "model.pt2") throw ArtifactError(file + ": aoti.file must be 'model.pt2'");
    for (const char* key : {"sha256", "target_isa", "torch"}) need(aoti, key, Kind::String, "aoti.");
    for (const auto& [key, span] : need(aoti, "dynamic", Kind::Object, "aoti.").items())
      if (!span.is_array() || span.size() != 2 || !span[0].is_number_integer() || !span[1].is_number_integer())
        throw ArtifactError(file + ": aoti.dynamic['" + key + "'] must be [min, max] sizes");
    const json& in = need(aoti, "input_order", Kind::Array, "aoti.");
    json want = {"dense", "lengths", "values"};
    if (m["weighted"].get<bool>()) want.push_back("weights");
    if (in != want) throw ArtifactError(file + ": aoti.input_order must be " + want.dump() + ", got " + in.dump());
    std::set<std::string> names, outputs;
    for (const auto& name : need(aoti, "output_order", Kind::Array, "aoti.")) {
      if (!name.is_string() || !names.insert(name.get<std::string>()).second)
        throw ArtifactError(file + ": aoti.output_order must name every output once");
    }
    for (const auto& [name, out] : m["outputs"].items()) outputs.insert(name);
    if (names != outputs) throw ArtifactError(file + ": aoti.output_order must name every output once");
    need(aoti, "compile_seconds", Kind::Number, "aoti.");
  }
}

// CPU flags (/proc/cpuinfo) each -march level needs, as recship/export/aoti.py's _ISA_FLAGS.
const std::map<std::string, std::vector<std::string>>& isa_flags() {
  static const std::map<std::string, std::vector<std::string>> flags = {
      {"x86-64-v2", {"sse4_2", "popcnt", "ssse3"}},
      {"x86-64-v3", {"sse4_2", "popcnt", "ssse3", "avx", "avx2", "bmi1", "bmi2", "fma", "movbe"}},
      {"x86-64-v4", {"sse4_2", "popcnt", "ssse3", "avx", "avx2", "bmi1", "bmi2", "fma", "movbe", "avx512f", "avx512bw",
                     "avx512cd", "avx512dq", "avx512vl"}},
  };
  return flags;
}

// The flags this CPU lacks to run code built with -march=isa ("" if none); unknown ISAs ("native") and hosts
// without /proc/cpuinfo are taken on trust, as recship.export.aoti.cpu_supports does.
std::string missing_cpu_flags(const std::string& isa) {
  auto needed = isa_flags().find(isa);
  std::ifstream in("/proc/cpuinfo");
  if (needed == isa_flags().end() || !in) return "";
  std::set<std::string> have;
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("flags", 0) == 0 && line.find(':') != std::string::npos) {
      std::istringstream words(line.substr(line.find(':') + 1));
      for (std::string w; words >> w;) have.insert(w);
      break;
    }
  }
  std::string missing;
  for (const auto& f : needed->second)
    if (!have.count(f) && !(f == "bmi1" && have.count("bmi2"))) missing += (missing.empty() ? "" : " ") + f;
  return missing;
}

// Why this process cannot run the artifact's model.pt2 ("" if it can).
std::string aoti_blocker(const json& m, int64_t max_batch_size) {
  if (!m.contains("aoti")) return "the artifact has no model.pt2 (exported with --format torchscript)";
  const json& aoti = m["aoti"];
  const std::string built = aoti["torch"].get<std::string>();
  const std::string running = std::string(RECSHIP_TORCH_VERSION).empty() ? TORCH_VERSION : RECSHIP_TORCH_VERSION;
  // without the configure-time version only the release can be compared
  if (std::string(RECSHIP_TORCH_VERSION).empty() ? release(built) != running : built != running)
    return "model.pt2 was compiled by torch " + built + ", this binary runs torch " + running;
  const std::string isa = aoti["target_isa"].get<std::string>();
  std::string missing = missing_cpu_flags(isa);
  if (!missing.empty()) return "model.pt2 targets " + isa + "; this CPU lacks " + missing;
  auto batch = aoti["dynamic"].find("dense.0");
  if (batch != aoti["dynamic"].end() && (*batch)[1].get<int64_t>() < max_batch_size)
    return "model.pt2 takes batches up to " + std::to_string((*batch)[1].get<int64_t>()) + ", below max_batch_size " +
           std::to_string(max_batch_size);
  return "";
}

// AOTIModelPackageLoader reads a path, not bytes: the verified bytes go to a private copy (a fresh mkdtemp
// folder, mode 0700) removed once loaded, so a model.pt2 swapped after the checksum cannot slip in.
// constants: fqn -> tensor for a package compiled without its constants (format 2: every one it asks for, mapped
// from tables.bin, as aliases that own nothing: tables::aoti_constants); the package uses their memory itself
// (user-managed), so the caller keeps the mapped tensors alive as long as the loader.
std::unique_ptr<torch::inductor::AOTIModelPackageLoader> load_aoti(const std::string& bytes, const std::string& file,
                                                                   std::unordered_map<std::string, at::Tensor>* constants) {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/recship-aoti-XXXXXX";
  if (!mkdtemp(pattern.data())) throw ArtifactError("cannot create a private folder for " + file + ": " + std::strerror(errno));
  const std::string copy = pattern + "/model.pt2";
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader;
  std::string error;
  {
    std::ofstream out(copy, std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out.flush()) error = "cannot write a private copy of " + file + " to " + copy;
  }
  if (error.empty()) {
    try {
      // runners: concurrent predict calls each take one (a call waits while all are busy); they share the weights
      const size_t runners = std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 8);
      loader = std::make_unique<torch::inductor::AOTIModelPackageLoader>(copy, "model", false, runners);
    } catch (const c10::Error& e) {
      error = file + " cannot be loaded: " + e.what_without_backtrace();
    } catch (const std::exception& e) {
      error = file + " cannot be loaded: " + e.what();
    }
  }
  if (error.empty() && constants != nullptr) {
    try {
      loader->load_constants(*constants, /*use_inactive=*/false, /*check_full_update=*/true, /*user_managed=*/true);
    } catch (const c10::Error& e) {
      std::string what = e.what_without_backtrace();
      error = file + ": its constants do not fit: " + what.substr(0, what.find('\n'));
    } catch (const std::exception& e) {
      std::string what = e.what();
      error = file + ": its constants do not fit: " + what.substr(0, what.find('\n'));
    }
  }
  std::remove(copy.c_str());
  rmdir(pattern.c_str());
  if (!error.empty()) throw ArtifactError(error);
  return loader;
}

}  // namespace

// A validated request as the model's tensors: dense [B, num_dense] f32, lengths [F*B] i32, values [N] i64,
// weights [N] f32 (undefined unless the model is weighted).
struct Inputs {
  torch::Tensor dense, lengths, values, weights;
};

struct Model::Impl {
  std::string dir;
  json manifest;
  std::string format;       // "torchscript" | "aoti"
  std::string format_note;  // why "auto" left model.pt2 unused
  // format 2: the tensors mapped from tables.bin (each keeps the mapping alive) and the constants model.pt2 was
  // given; declared before the models, so they outlive them (model.pt2 holds raw pointers into them)
  std::map<std::string, at::Tensor> tables;
  std::unordered_map<std::string, at::Tensor> aoti_constants;
  mutable torch::jit::Module module;                                 // format "torchscript"
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> aoti;     // format "aoti"
  std::vector<std::string> aoti_outputs;                             // its flat outputs' names, in order
  std::vector<std::string> features;
  std::map<std::string, int64_t> rows;
  std::map<std::string, bool> modulo;
  bool weighted = false;                      // any feature takes weights: the model gets a weights tensor
  std::map<std::string, bool> feature_weighted;  // which features take them (ids of the others get weight 1)
  int64_t num_dense = 0;
  int64_t max_batch_size = 512;

  Prepared prepare(const Request& r) const;
  Inputs inputs(const std::vector<const Prepared*>& requests) const;
  // Runs the loaded model on validated inputs (AOTI checks no shapes: never call it with anything else).
  std::vector<std::pair<std::string, torch::Tensor>> forward(const Inputs& in) const;
};

void set_intra_op_threads(int threads) { at::set_num_threads(threads); }

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
  if (options.format != "auto" && options.format != "torchscript" && options.format != "aoti")
    throw Error("LoadOptions::format must be auto, torchscript or aoti, got '" + options.format + "'");
  m.format = options.format == "auto" ? "torchscript" : options.format;
  if (options.format != "torchscript") {
    std::string blocker = aoti_blocker(m.manifest, m.max_batch_size);
    if (blocker.empty()) m.format = "aoti";
    else if (options.format == "aoti") throw ArtifactError(artifact_dir + ": " + blocker);
    else if (m.manifest.contains("aoti")) m.format_note = blocker;
  }
  const bool aoti = m.format == "aoti";
  const std::string file = aoti ? "model.pt2" : "model.pt";
  const std::string want = aoti ? m.manifest["aoti"]["sha256"].get<std::string>() : m.manifest["model_sha256"].get<std::string>();
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
  // format 2: the tables first (mapped and verified, then shared with a live version where its tables are equal),
  // then the model file, as export/artifact.py open_artifact does
  std::optional<tables::Spec> spec;
  if (m.manifest.contains("tables")) {
    spec = tables::parse_spec(m.manifest["tables"], artifact_dir + "/manifest.json");
    m.tables = tables::map_tables(artifact_dir, *spec);
  }
  // the model file is small beside its tables (format 2): read whole, hashed, and loaded from these very bytes
  std::string model_bytes = read_file(artifact_dir + "/" + file, file.c_str());
  std::string digest = sha256_hex(model_bytes);
  if (digest != want)
    throw ArtifactError(artifact_dir + "/" + file + ": sha256 " + digest + " does not match the manifest's " + want);
  for (const auto& lib : m.manifest["op_libraries"]) {
    std::string path = fbgemm_dir + "/" + lib.get<std::string>();
    if (!dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL)) {
      const char* err = dlerror();
      throw MissingLibrary("cannot load fbgemm op library " + path + ": " + (err ? err : "unknown error"));
    }
  }
  if (aoti) {
    if (spec) {
      tables::check_pinned(tables::zip_entry(model_bytes, "/extra/" + kPinnedName), *spec, artifact_dir + "/model.pt2");
      m.aoti_constants = tables::aoti_constants(*spec, m.tables);
    }
    m.aoti = load_aoti(model_bytes, artifact_dir + "/model.pt2", spec ? &m.aoti_constants : nullptr);
    m.aoti_outputs = m.manifest["aoti"]["output_order"].get<std::vector<std::string>>();
  } else {
    torch::jit::ExtraFilesMap extra;
    if (spec) extra[kPinnedName] = "";
    try {
      m.module = torch::jit::load(std::make_shared<BytesAdapter>(model_bytes), torch::kCPU, extra);
      m.module.eval();
    } catch (const c10::Error& e) {
      throw ArtifactError(artifact_dir + "/model.pt cannot be loaded: " + e.what_without_backtrace());
    }
    if (spec) {
      tables::check_pinned(extra[kPinnedName], *spec, artifact_dir + "/model.pt");
      tables::attach_torchscript(m.module, *spec, m.tables, artifact_dir);
    }
  }
  model_bytes.clear();
  model_bytes.shrink_to_fit();
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
Prepared Model::Impl::prepare(const Request& r) const {
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
  Prepared p;
  p.batch_size = b;
  p.lengths.resize(features.size() * b);
  p.ids.resize(total);
  p.feature_ids.reserve(features.size());
  if (weighted) p.weights.resize(total);
  int32_t* lp = p.lengths.data();
  int64_t* vp = p.ids.data();
  float* wp = p.weights.data();
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
    p.feature_ids.push_back(static_cast<int64_t>(f.ids.size()));
  }
  if (!(num_dense == 0 && r.dense.empty() && r.dense_rows == 0 && r.dense_cols == 0)) {
    if (r.dense_rows != b || r.dense_cols != num_dense)
      throw InvalidRequest("dense shape [" + std::to_string(r.dense_rows) + ", " + std::to_string(r.dense_cols) +
                           "] does not match [batch_size, " + std::to_string(num_dense) + "] = [" + std::to_string(b) +
                           ", " + std::to_string(num_dense) + "]");
    if (static_cast<int64_t>(r.dense.size()) != b * num_dense)
      throw InvalidRequest("dense has " + std::to_string(r.dense.size()) + " values for shape [" + std::to_string(b) + ", " +
                           std::to_string(num_dense) + "]");
    for (float x : r.dense)
      if (!std::isfinite(x)) throw InvalidRequest("dense values must be finite (no NaN or infinity)");
    p.dense = r.dense;
  }
  return p;
}

// Prepared requests -> one set of input tensors, concatenated along the batch: lengths and ids stay feature-major
// (feature 0 of every request, then feature 1, ...), dense rows request after request.
Inputs Model::Impl::inputs(const std::vector<const Prepared*>& requests) const {
  const int64_t nf = static_cast<int64_t>(features.size());
  int64_t b = 0, total = 0;
  for (const Prepared* p : requests) {
    if (static_cast<int64_t>(p->feature_ids.size()) != nf || static_cast<int64_t>(p->lengths.size()) != nf * p->batch_size ||
        static_cast<int64_t>(p->dense.size()) != p->batch_size * num_dense || (weighted && p->weights.size() != p->ids.size()))
      throw Error("predict_batch: a request was not prepared by this model");
    b += p->batch_size;
    total += static_cast<int64_t>(p->ids.size());
  }
  if (requests.empty() || b > max_batch_size)
    throw Error("predict_batch takes 1 to max_batch_size (" + std::to_string(max_batch_size) + ") examples, got " + std::to_string(b));
  auto lengths = torch::empty({nf * b}, torch::kInt32);
  auto values = torch::empty({total}, torch::kInt64);
  auto weights = torch::empty({weighted ? total : 0}, torch::kFloat32);
  auto dense = torch::empty({b, num_dense}, torch::kFloat32);
  int32_t* lp = lengths.data_ptr<int32_t>();
  int64_t* vp = values.data_ptr<int64_t>();
  float* wp = weights.data_ptr<float>();
  std::vector<int64_t> offset(requests.size(), 0);  // each request's read position in its ids
  for (int64_t f = 0; f < nf; ++f) {
    for (size_t r = 0; r < requests.size(); ++r) {
      const Prepared& p = *requests[r];
      lp = std::copy_n(p.lengths.data() + f * p.batch_size, p.batch_size, lp);
      const int64_t n = p.feature_ids[f];
      vp = std::copy_n(p.ids.data() + offset[r], n, vp);
      if (weighted) wp = std::copy_n(p.weights.data() + offset[r], n, wp);
      offset[r] += n;
    }
  }
  float* dp = dense.data_ptr<float>();
  for (const Prepared* p : requests) dp = std::copy(p->dense.begin(), p->dense.end(), dp);
  return {dense, lengths, values, weighted ? weights : torch::Tensor()};
}

std::vector<std::pair<std::string, torch::Tensor>> Model::Impl::forward(const Inputs& in) const {
  c10::InferenceMode guard;
  std::vector<std::pair<std::string, torch::Tensor>> out;
  try {
    if (aoti) {
      // the package's flat signature (aoti.input_order): dense, lengths, values, and weights only when the
      // model is weighted (an unweighted one was exported with weights=None, which flattens to nothing)
      std::vector<at::Tensor> args{in.dense, in.lengths, in.values};
      if (weighted) args.push_back(in.weights);
      std::vector<at::Tensor> result = aoti->run(args);
      if (result.size() != aoti_outputs.size())
        throw Error("the model failed: model.pt2 returned " + std::to_string(result.size()) + " outputs, the manifest names " +
                    std::to_string(aoti_outputs.size()));
      for (size_t i = 0; i < result.size(); ++i) out.emplace_back(aoti_outputs[i], std::move(result[i]));
    } else {
      std::vector<torch::jit::IValue> args{in.dense, in.lengths, in.values};
      args.emplace_back(weighted ? torch::jit::IValue(in.weights) : torch::jit::IValue());
      for (const auto& item : module.forward(args).toGenericDict())
        out.emplace_back(item.key().toStringRef(), item.value().toTensor());
    }
  } catch (const c10::Error& e) {
    throw Error(std::string("the model failed: ") + e.what_without_backtrace());
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {  // AOTI's runtime reports errors as std::runtime_error
    throw Error(std::string("the model failed: ") + e.what());
  }
  return out;
}

Prepared Model::prepare(const Request& request) const { return impl_->prepare(request); }

std::vector<NamedOutputs> Model::predict_batch(const std::vector<const Prepared*>& requests) const {
  std::vector<NamedOutputs> out(requests.size());
  int64_t b = 0;
  for (const Prepared* p : requests) b += p->batch_size;
  for (const auto& [name, tensor] : impl_->forward(impl_->inputs(requests))) {
    if (tensor.dim() == 0 || tensor.size(0) != b)
      throw Error("the model failed: output '" + name + "' has shape " + c10::str(tensor.sizes()) + ", not a batch of " +
                  std::to_string(b) + " first");
    torch::Tensor t = tensor.to(torch::kFloat32).contiguous();
    const int64_t row = b ? t.numel() / b : 0;  // values per example
    const float* data = t.data_ptr<float>();
    for (size_t r = 0; r < requests.size(); ++r) {
      Output o;
      o.shape.assign(t.sizes().begin(), t.sizes().end());
      o.shape[0] = requests[r]->batch_size;
      o.values.assign(data, data + requests[r]->batch_size * row);
      data += requests[r]->batch_size * row;
      out[r].emplace_back(name, std::move(o));
    }
  }
  return out;
}

std::map<std::string, Output> Model::predict(const Request& request) const {
  Prepared p = impl_->prepare(request);
  std::map<std::string, Output> out;
  std::vector<NamedOutputs> batch = predict_batch({&p});
  for (auto& [name, o] : batch[0]) out[name] = std::move(o);
  return out;
}

double Model::forward_ms(const Request& request, int runs) const {
  Prepared p = impl_->prepare(request);
  Inputs in = impl_->inputs({&p});
  std::vector<double> ms;
  for (int i = 0; i < runs; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    impl_->forward(in);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms.empty() ? 0.0 : ms[ms.size() / 2];
}

const std::vector<std::string>& Model::feature_names() const { return impl_->features; }
const std::string& Model::format() const { return impl_->format; }
const std::string& Model::format_note() const { return impl_->format_note; }
int64_t Model::num_dense() const { return impl_->num_dense; }
int64_t Model::max_batch_size() const { return impl_->max_batch_size; }

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
