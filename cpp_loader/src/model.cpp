// recship::Model: manifest, checksum, op libraries, TorchScript module or AOTInductor package, validation, predict.
#include "recship/model.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/stat.h>
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

#include "manifest.h"
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

// fbgemm_gpu's folder as the wheel lays it out: this library is site-packages/recship/_cpp/lib/librecship_loader.so,
// fbgemm_gpu is site-packages/fbgemm_gpu ("" where this library's own path cannot be found).
std::string wheel_fbgemm_dir() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<const void*>(&wheel_fbgemm_dir), &info) == 0 || info.dli_fname == nullptr) return "";
  std::string lib = info.dli_fname;
  std::size_t slash = lib.rfind('/');
  return (slash == std::string::npos ? std::string(".") : lib.substr(0, slash)) + "/../../../fbgemm_gpu";
}

// The bytes of the file at path, or nullopt with errno set (a folder: EISDIR).
std::optional<std::string> read_bytes(const std::string& path) {
  struct stat st {};
  std::string out;
  if (!tables::read_chunks(path, 1 << 16, &st, [&out](const char* data, size_t n) { out.append(data, n); })) return std::nullopt;
  return out;
}

// What Python's pathlib raises as FileNotFoundError, IsADirectoryError or NotADirectoryError: "is missing".
bool missing(int error) { return error == ENOENT || error == EISDIR || error == ENOTDIR; }

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


const std::string kPinnedName = "recship/tables.json";  // model.pt's extra file, model.pt2's <root>/extra/ entry

// CPU flags (/proc/cpuinfo) each -march level needs, as export/aoti.py's _ISA_FLAGS.
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

// The artifact's sample, read and verified (Impl::read_sample): the request's tensors as the files hold them and the
// recorded outputs by name, with their shapes.
struct Sample {
  int64_t batch_size = 0;
  std::vector<float> dense;
  std::vector<int32_t> lengths;  // [features x batch_size], feature-major
  std::vector<int64_t> values;
  std::vector<float> weights;    // empty unless the sample has weights
  std::map<std::string, Output> outputs;
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
  std::map<std::string, int64_t> bound;  // a "reject" feature's ids lie in [0, bound): id_bound, else rows
  std::map<std::string, bool> modulo;
  bool weighted = false;                      // any feature takes weights: the model gets a weights tensor
  std::map<std::string, bool> feature_weighted;  // which features take them (ids of the others get weight 1)
  int64_t num_dense = 0;
  int64_t max_batch_size = rules::kMaxBatchSizeDefault;
  int64_t row_block = 0;  // examples per forward (manifest row_block; 0: whole batches): export/blocks.py

  // One forward of the loaded model on validated inputs, whatever their batch.
  std::vector<std::pair<std::string, torch::Tensor>> forward_once(const Inputs& in) const;

  // limit: the largest batch accepted (max_batch_size, but for the sample's self-check)
  Prepared prepare(const Request& r, int64_t limit) const;
  Inputs inputs(const std::vector<const Prepared*>& requests, int64_t limit) const;
  // Runs the loaded model on validated inputs (AOTI checks no shapes: never call it with anything else), in
  // blocks of exactly row_block examples where the manifest has one, as export/blocks.py run_in_blocks does.
  std::vector<std::pair<std::string, torch::Tensor>> forward(const Inputs& in) const;
  // The sample files, verified as export/artifact.py read_sample does, with its words (ArtifactError naming the file).
  Sample read_sample() const;
  Request request(const Sample& sample) const;
  // Runs the sample: every output (by name) must have the recorded shape, be finite and within 1e-5 (self_check).
  void self_check(const Sample& sample) const;
};

void set_intra_op_threads(int threads) { at::set_num_threads(threads); }

Model::Model() : impl_(std::make_unique<Impl>()) {}
Model::~Model() = default;

std::unique_ptr<Model> Model::load(const std::string& artifact_dir, const LoadOptions& options) {
  std::unique_ptr<Model> model(new Model());
  Impl& m = *model->impl_;
  m.dir = artifact_dir;
  if (options.max_batch_size < 1) throw Error("LoadOptions::max_batch_size must be >= 1");
  if (options.format != "auto" && options.format != "torchscript" && options.format != "aoti")
    throw Error("LoadOptions::format must be auto, torchscript or aoti, got '" + options.format + "'");
  m.max_batch_size = options.max_batch_size;
  // The artifact is verified as a unit before any of it runs, in the contract's open order (recship/contract/__init__.py).
  // 1. manifest.json: its sha256 (the allow-list pins manifests), then the contract.
  const std::optional<std::string> raw = read_bytes(artifact_dir + "/manifest.json");
  if (!raw) {
    if (missing(errno)) throw ArtifactError(artifact_dir + ": not an artifact (manifest.json is missing)");
    throw ArtifactError(artifact_dir + "/manifest.json cannot be read: " + std::strerror(errno));
  }
  const std::string manifest_digest = sha256_hex(*raw);
  if (options.trusted && !options.trusted->count(manifest_digest)) {
    std::string text = artifact_dir + "/manifest.json: sha256 " + manifest_digest + " is not in the trusted list";
    for (const char* name : {"model.pt", "model.pt2"}) {
      const std::optional<std::string> listed = tables::sha256_file(artifact_dir + "/" + name);
      if (listed && options.trusted->count(*listed)) {
        text += std::string(" (the list names this version's ") + name + "; it pins manifest.json, whose checksums pin every " +
                "file of the version: list " + manifest_digest + ", e.g. sha256sum */*/manifest.json)";
        break;
      }
    }
    throw ArtifactError(text);
  }
  try {
    // nlohmann's parser takes a NUL byte for the end of its input (what follows is never read); Python's json refuses it
    const size_t nul = raw->find('\0');
    if (nul != std::string::npos)
      throw ArtifactError(artifact_dir + "/manifest.json is corrupt: a NUL byte at offset " + std::to_string(nul));
    m.manifest = json::parse(*raw);
  } catch (const json::exception& e) {
    throw ArtifactError(artifact_dir + "/manifest.json is corrupt: " + e.what());
  }
  check_manifest(m.manifest, artifact_dir + "/manifest.json");
  for (const auto& f : m.manifest["sparse_features"]) {
    std::string name = f["name"];
    m.features.push_back(name);
    m.rows[name] = f["rows"].get<int64_t>();
    m.bound[name] = f.value("id_bound", m.rows[name]);  // id_bound: a managed-collision module remaps the ids in the model
    m.modulo[name] = f["id_policy"].get<std::string>() == "modulo";
  }
  m.weighted = m.manifest["weighted"].get<bool>();
  for (const auto& f : m.manifest["sparse_features"])
    m.feature_weighted[f["name"].get<std::string>()] = f.value("weighted", m.weighted);
  m.num_dense = m.manifest["num_dense"].get<int64_t>();
  m.row_block = m.manifest.value("row_block", int64_t{0});
  // 2. the torch and fbgemm_gpu it was built with
  // LoadOptions::fbgemm_dir, else $RECSHIP_FBGEMM_DIR (recship.native sets it to the fbgemm_gpu Python imports), else
  // the folder recorded at build time (a source build), else the fbgemm_gpu installed beside the wheel this library
  // came in (a relocatable build records none)
  const char* env_fbgemm = std::getenv("RECSHIP_FBGEMM_DIR");
  std::string fbgemm_dir = !options.fbgemm_dir.empty()         ? options.fbgemm_dir
                           : env_fbgemm && *env_fbgemm != '\0' ? std::string(env_fbgemm)
                           : *RECSHIP_FBGEMM_DIR != '\0'        ? std::string(RECSHIP_FBGEMM_DIR)
                                                               : wheel_fbgemm_dir();
  if (options.check_versions) {
    std::string built_torch = release(m.manifest["versions"]["torch"].get<std::string>());
    std::string running_torch = release(TORCH_VERSION);
    if (built_torch != running_torch)
      throw VersionMismatch(artifact_dir + "/manifest.json: artifact built with torch " + built_torch + ", this loader runs torch " + running_torch);
    std::string built_fbgemm = m.manifest["versions"]["fbgemm_gpu"].get<std::string>();
    std::string found = fbgemm_version(fbgemm_dir);
    if (!found.empty() && release(found) != release(built_fbgemm))
      throw VersionMismatch(artifact_dir + "/manifest.json: artifact built with fbgemm_gpu " + built_fbgemm + ", this loader runs fbgemm_gpu " + found);
  }
  // 3. which model file runs
  const bool has_torchscript = m.manifest.contains("model_sha256");  // else model.pt2 is the artifact's only program
  if (!has_torchscript && options.format == "torchscript")
    throw ArtifactError(artifact_dir + " has no model.pt: TorchScript could not compile this model at export, its program is "
                        "model.pt2 (load it with format auto or aoti)");
  m.format = options.format == "auto" ? "torchscript" : options.format;
  if (options.format != "torchscript") {
    std::string blocker = aoti_blocker(m.manifest, m.max_batch_size);
    if (blocker.empty()) m.format = "aoti";
    else if (!has_torchscript)
      throw ArtifactError(artifact_dir + ": " + blocker + " (and the artifact has no model.pt: TorchScript could not compile the model)");
    else if (options.format == "aoti") throw ArtifactError(artifact_dir + ": " + blocker);
    else if (m.manifest.contains("aoti")) m.format_note = blocker;
  }
  const bool aoti = m.format == "aoti";
  const std::string used = aoti ? "model.pt2" : "model.pt";
  std::optional<tables::Spec> spec;
  if (m.manifest.contains("tables")) spec = tables::parse_spec(m.manifest["tables"]);
  // 4. every model file the manifest lists, by sha256, whichever runs: the one that runs (and with tables.bin, the
  // other: its copy of the tables spec is checked too) read whole and loaded from these very bytes
  std::vector<std::pair<std::string, std::string>> files;
  if (has_torchscript) files.emplace_back("model.pt", m.manifest["model_sha256"].get<std::string>());
  if (m.manifest.contains("aoti")) files.emplace_back("model.pt2", m.manifest["aoti"]["sha256"].get<std::string>());
  std::map<std::string, std::string> bytes;
  for (const auto& [name, want] : files) {
    const std::string path = artifact_dir + "/" + name;
    std::optional<std::string> digest;
    if (name == used || spec) {
      std::optional<std::string> data = read_bytes(path);
      if (data) {
        digest = sha256_hex(*data);
        bytes[name] = std::move(*data);
      }
    } else {
      digest = tables::sha256_file(path);
    }
    if (!digest) {
      if (missing(errno)) throw ArtifactError(artifact_dir + ": " + name + " is missing");
      throw ArtifactError(path + ": cannot be read: " + std::strerror(errno));
    }
    if (*digest != want) throw ArtifactError(path + ": sha256 " + *digest + " does not match the manifest's " + want);
  }
  // 5. tables.bin (mapped and every table verified, then shared with a live version where its tables are equal), and
  // 6. each model file's copy of the tables spec
  if (spec) {
    m.tables = tables::map_tables(artifact_dir, *spec);
    for (const auto& [name, _] : files)
      tables::check_pinned(tables::zip_entry(bytes[name], "/extra/" + kPinnedName), *spec, artifact_dir + "/" + name);
  }
  // 7. the sample: every file's size, a valid request, finite outputs
  std::optional<Sample> sample;
  if (options.self_check) sample = m.read_sample();
  // 8. the op libraries, then the model from the verified bytes
  std::string model_bytes = std::move(bytes[used]);
  bytes.clear();
  for (const auto& lib : m.manifest["op_libraries"]) {
    std::string path = fbgemm_dir + "/" + lib.get<std::string>();
    struct stat st {};
    if (stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode))  // a name fbgemm_gpu does not ship (open_artifact's words)
      throw MissingLibrary(artifact_dir + "/manifest.json: op_libraries: cannot load fbgemm op library " +
                           tables::py_repr(lib.get<std::string>()) + ": it is not in " + fbgemm_dir);
    if (!dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL)) {
      const char* err = dlerror();
      throw MissingLibrary("cannot load fbgemm op library " + path + ": " + (err ? err : "unknown error"));
    }
  }
  if (aoti) {
    if (spec) m.aoti_constants = tables::aoti_constants(*spec, m.tables);
    m.aoti = load_aoti(model_bytes, artifact_dir + "/model.pt2", spec ? &m.aoti_constants : nullptr);
    m.aoti_outputs = m.manifest["aoti"]["output_order"].get<std::vector<std::string>>();
  } else {
    try {
      m.module = torch::jit::load(std::make_shared<BytesAdapter>(model_bytes), torch::kCPU);
      m.module.eval();
    } catch (const c10::Error& e) {
      throw ArtifactError(artifact_dir + "/model.pt cannot be loaded: " + e.what_without_backtrace());
    }
    if (spec) tables::attach_torchscript(m.module, *spec, m.tables, artifact_dir);
  }
  model_bytes.clear();
  model_bytes.shrink_to_fit();
  if (sample) m.self_check(*sample);
  return model;
}

namespace {

// The bytes of a sample file as T (its dtype: check_manifest holds each input's and output's to the one its role
// needs), after its size is the one its shape needs.
template <typename T>
std::vector<T> read_tensor(const std::string& dir, const json& spec) {
  const std::string file = spec["file"].get<std::string>();
  std::vector<int64_t> shape;
  unsigned __int128 need = sizeof(T);
  const unsigned __int128 cap = static_cast<unsigned __int128>(1) << 120;
  for (const auto& d : spec["shape"]) {
    shape.push_back(d.get<int64_t>());
    need = std::min(cap, need * std::min<unsigned __int128>(cap, d.get<uint64_t>()));
  }
  const std::optional<std::string> bytes = read_bytes(dir + "/" + file);
  if (!bytes) throw ArtifactError(dir + ": sample file " + tables::py_repr(file) + " cannot be read: " + std::strerror(errno));
  if (bytes->size() != need)
    throw ArtifactError(dir + ": sample file " + tables::py_repr(file) + " has " + std::to_string(bytes->size()) + " bytes, its shape " +
                        py_list(shape) + " needs " + to_string128(need));
  std::vector<T> out(bytes->size() / sizeof(T));
  if (!out.empty()) std::memcpy(out.data(), bytes->data(), bytes->size());  // artifacts are little-endian, as is x86/arm
  return out;
}

std::string format_3g(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3g", v);
  return buf;
}

}  // namespace

Sample Model::Impl::read_sample() const {
  const json& s = manifest["sample"];
  const json& in = s["inputs"];
  Sample out;
  out.batch_size = s["batch_size"].get<int64_t>();
  // every file's size first, in read_sample's order: dense, lengths, values, weights, then the outputs by name
  out.dense = read_tensor<float>(dir, in["dense"]);
  out.lengths = read_tensor<int32_t>(dir, in["lengths"]);
  out.values = read_tensor<int64_t>(dir, in["values"]);
  if (in.contains("weights")) out.weights = read_tensor<float>(dir, in["weights"]);
  for (const auto& [name, spec] : s["outputs"].items()) {  // sorted by name
    Output o;
    o.shape = spec["shape"].get<std::vector<int64_t>>();
    o.values = read_tensor<float>(dir, spec);
    out.outputs[name] = std::move(o);
  }
  // then the inputs as a request: the server's rules (and words) for what a file can get wrong
  auto bad = [&](const char* input, const std::string& why) {
    return ArtifactError(dir + ": sample file " + tables::py_repr(in[input]["file"].get<std::string>()) +
                         " is not a valid request: " + why);
  };
  const int64_t b = out.batch_size;
  std::vector<int64_t> counts;
  int64_t total = 0;
  for (size_t f = 0; f < features.size(); ++f) {
    int64_t count = 0;
    for (int64_t i = 0; i < b; ++i) {
      const int32_t n = out.lengths[f * b + i];
      if (n < 0) throw bad("lengths", "sparse feature " + tables::py_repr(features[f]) + ": negative length " + std::to_string(n));
      count += n;
    }
    counts.push_back(count);
    total += count;
  }
  if (total != static_cast<int64_t>(out.values.size()))
    throw bad("lengths", "its lengths sum to " + std::to_string(total) + ", but " + tables::py_repr(in["values"]["file"].get<std::string>()) +
                             " holds " + std::to_string(out.values.size()) + " ids");
  int64_t start = 0;
  for (size_t f = 0; f < features.size(); ++f) {
    const int64_t limit = bound.at(features[f]);
    if (!modulo.at(features[f]))
      for (int64_t k = start; k < start + counts[f]; ++k)
        if (out.values[k] < 0 || out.values[k] >= limit)
          // the wording of recship.sparse.ids.out_of_range_message
          throw bad("values", "feature '" + features[f] + "': id " + std::to_string(out.values[k]) + " is out of range [0, " +
                                  std::to_string(limit) + ")");
    start += counts[f];
  }
  for (float x : out.dense)
    if (!std::isfinite(x)) throw bad("dense", "dense values must be finite (no NaN or infinity)");
  if (in.contains("weights")) {
    start = 0;
    for (size_t f = 0; f < features.size(); ++f) {
      if (feature_weighted.at(features[f]))
        for (int64_t k = start; k < start + counts[f]; ++k)
          if (!std::isfinite(out.weights[k]))
            throw bad("weights", "sparse feature " + tables::py_repr(features[f]) + ": weights must be finite");
      start += counts[f];
    }
  }
  for (const auto& [name, o] : out.outputs)
    for (float x : o.values)
      if (!std::isfinite(x))
        throw ArtifactError(dir + ": sample file " + tables::py_repr(s["outputs"][name]["file"].get<std::string>()) +
                            " holds NaN or infinity");
  return out;
}

Request Model::Impl::request(const Sample& sample) const {
  Request r;
  r.batch_size = sample.batch_size;
  size_t l = 0, v = 0;  // read_sample checked that the lengths are >= 0 and sum to the values
  for (const auto& name : features) {
    Feature f;
    f.lengths.assign(sample.lengths.begin() + l, sample.lengths.begin() + l + r.batch_size);
    l += r.batch_size;
    int64_t n = 0;
    for (int32_t x : f.lengths) n += x;
    f.ids.assign(sample.values.begin() + v, sample.values.begin() + v + n);
    if (!sample.weights.empty() && feature_weighted.at(name)) f.weights.assign(sample.weights.begin() + v, sample.weights.begin() + v + n);
    v += n;
    r.sparse[name] = std::move(f);
  }
  r.dense = sample.dense;
  r.dense_rows = r.batch_size;
  r.dense_cols = num_dense;
  if (num_dense == 0) r.dense_rows = r.dense_cols = 0;
  return r;
}

void Model::Impl::self_check(const Sample& sample) const {
  const int64_t limit = std::max(max_batch_size, sample.batch_size);  // the sample runs whatever the serving limit
  Prepared p;
  try {
    p = prepare(request(sample), limit);
  } catch (const InvalidRequest& e) {  // read_sample checks what a file can get wrong: not expected
    throw ArtifactError(dir + ": the sample is not a valid request: " + e.what());
  }
  std::map<std::string, torch::Tensor> got;
  for (auto& [name, tensor] : forward(inputs({&p}, limit))) got.emplace(name, tensor);
  for (const auto& [name, want] : sample.outputs) {
    auto it = got.find(name);
    if (it == got.end()) throw ArtifactError(dir + ": the model does not produce output " + tables::py_repr(name));
    const torch::Tensor t = it->second.to(torch::kCPU).to(torch::kFloat32).contiguous();
    const std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
    const std::string where = dir + ": sample self-check failed on output " + tables::py_repr(name);
    const std::string file = manifest["sample"]["outputs"][name]["file"].get<std::string>();
    if (shape != want.shape) throw ArtifactError(where + ": shape " + py_list(shape) + ", " + tables::py_repr(file) + " holds " + py_list(want.shape));
    const float* data = t.data_ptr<float>();
    float worst = 0.0f;
    for (size_t i = 0; i < want.values.size(); ++i) {
      if (!std::isfinite(data[i])) throw ArtifactError(where + ": the model gave NaN or infinity");
      worst = std::max(worst, std::fabs(data[i] - want.values[i]));
    }
    if (!(static_cast<double>(worst) <= 1e-5))
      throw ArtifactError(where + ": it differs from " + tables::py_repr(file) + " by " + format_3g(worst));
  }
}

// Validation: the same rules and messages as the gRPC server (recship/serving/requests.py).
Prepared Model::Impl::prepare(const Request& r, int64_t limit) const {
  const int64_t b = r.batch_size;
  if (b <= 0) throw InvalidRequest("batch_size must be > 0, got " + std::to_string(b));
  if (b > limit) throw InvalidRequest("batch_size " + std::to_string(b) + " exceeds the model's limit of " + std::to_string(limit));
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
    const bool hash = modulo.at(name);
    const int64_t limit = hash ? rows.at(name) : bound.at(name);  // a modulo feature has no id_bound (check_manifest)
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
Inputs Model::Impl::inputs(const std::vector<const Prepared*>& requests, int64_t limit) const {
  const int64_t nf = static_cast<int64_t>(features.size());
  int64_t b = 0, total = 0;
  for (const Prepared* p : requests) {
    if (static_cast<int64_t>(p->feature_ids.size()) != nf || static_cast<int64_t>(p->lengths.size()) != nf * p->batch_size ||
        static_cast<int64_t>(p->dense.size()) != p->batch_size * num_dense || (weighted && p->weights.size() != p->ids.size()))
      throw Error("predict_batch: a request was not prepared by this model");
    b += p->batch_size;
    total += static_cast<int64_t>(p->ids.size());
  }
  if (requests.empty() || b > limit)
    throw Error("predict_batch takes 1 to max_batch_size (" + std::to_string(limit) + ") examples, got " + std::to_string(b));
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

// Batch invariance (export/blocks.py): every forward gets exactly row_block examples, the batch cut into blocks and
// the last padded with empty examples (no ids, zero dense), so each row meets the same kernels at the same shape
// whatever it was batched with. A block's ids stay feature-major: feature f's ids of the block's rows, f = 0, 1, ...
std::vector<std::pair<std::string, torch::Tensor>> Model::Impl::forward(const Inputs& in) const {
  const int64_t rows = row_block;
  const int64_t b = in.dense.size(0);
  const int64_t nf = static_cast<int64_t>(features.size());
  if (rows <= 0 || b < 1) return forward_once(in);
  const int64_t blocks = (b + rows - 1) / rows;
  const int32_t* lp = in.lengths.data_ptr<int32_t>();
  const int64_t* vp = in.values.data_ptr<int64_t>();
  const float* wp = weighted ? in.weights.data_ptr<float>() : nullptr;
  const float* dp = in.dense.data_ptr<float>();
  std::vector<int64_t> start(nf, 0);  // where feature f's ids of the current block begin in values
  for (int64_t f = 0, at = 0; f < nf; ++f) {
    start[f] = at;
    for (int64_t i = 0; i < b; ++i) at += lp[f * b + i];
  }
  std::vector<std::vector<std::pair<std::string, torch::Tensor>>> parts;
  parts.reserve(static_cast<size_t>(blocks));
  for (int64_t k = 0; k < blocks; ++k) {
    const int64_t first = k * rows, n = std::min(rows, b - first);
    int64_t ids = 0;
    for (int64_t f = 0; f < nf; ++f)
      for (int64_t i = 0; i < n; ++i) ids += lp[f * b + first + i];
    Inputs block{torch::zeros({rows, num_dense}, torch::kFloat32), torch::zeros({nf * rows}, torch::kInt32),
                 torch::empty({ids}, torch::kInt64), weighted ? torch::empty({ids}, torch::kFloat32) : torch::Tensor()};
    std::copy_n(dp + first * num_dense, n * num_dense, block.dense.data_ptr<float>());
    int32_t* bl = block.lengths.data_ptr<int32_t>();
    int64_t* bv = block.values.data_ptr<int64_t>();
    float* bw = weighted ? block.weights.data_ptr<float>() : nullptr;
    for (int64_t f = 0; f < nf; ++f) {
      int64_t count = 0;
      for (int64_t i = 0; i < n; ++i) count += (bl[f * rows + i] = lp[f * b + first + i]);
      bv = std::copy_n(vp + start[f], count, bv);
      if (weighted) bw = std::copy_n(wp + start[f], count, bw);
      start[f] += count;
    }
    parts.push_back(forward_once(block));
  }
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (size_t o = 0; o < parts[0].size(); ++o) {
    std::vector<torch::Tensor> pieces;
    for (const auto& part : parts) pieces.push_back(part[o].second);
    out.emplace_back(parts[0][o].first, torch::cat(pieces).narrow(0, 0, b));
  }
  return out;
}

std::vector<std::pair<std::string, torch::Tensor>> Model::Impl::forward_once(const Inputs& in) const {
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

Prepared Model::prepare(const Request& request) const { return impl_->prepare(request, impl_->max_batch_size); }

std::vector<NamedOutputs> Model::predict_batch(const std::vector<const Prepared*>& requests) const {
  std::vector<NamedOutputs> out(requests.size());
  int64_t b = 0;
  for (const Prepared* p : requests) b += p->batch_size;
  for (const auto& [name, tensor] : impl_->forward(impl_->inputs(requests, impl_->max_batch_size))) {
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
  Prepared p = impl_->prepare(request, impl_->max_batch_size);
  std::map<std::string, Output> out;
  std::vector<NamedOutputs> batch = predict_batch({&p});
  for (auto& [name, o] : batch[0]) out[name] = std::move(o);
  return out;
}

double Model::forward_ms(const Request& request, int runs) const {
  Prepared p = impl_->prepare(request, impl_->max_batch_size);
  Inputs in = impl_->inputs({&p}, impl_->max_batch_size);
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

Request Model::sample_request() const { return impl_->request(impl_->read_sample()); }

std::map<std::string, Output> Model::sample_outputs() const { return impl_->read_sample().outputs; }

}  // namespace recship
