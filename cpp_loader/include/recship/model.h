// recship C++ loader: run an exported recship artifact (model.pt + tables.bin + manifest.json + sample/) without Python,
// or its AOTInductor package (model.pt2, the manifest's "aoti") where it runs here.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "recship/serving_rules.h"  // generated from protos/recship/serving/v1/serving_rules.json

namespace recship {

// Every error the library throws derives from Error; the subclasses say what went wrong.
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct InvalidRequest : Error {  // the request does not fit the model (same rules and messages as the server)
  using Error::Error;
};
struct ArtifactError : Error {  // missing files, bad checksum, failed sample self-check, a model.pt2 that cannot run here
  using Error::Error;
};
struct MissingLibrary : Error {  // an fbgemm op library could not be loaded
  using Error::Error;
};
struct VersionMismatch : Error {  // the artifact was built with another torch / fbgemm_gpu
  using Error::Error;
};

struct Feature {
  std::vector<int32_t> lengths;  // [batch_size]
  std::vector<int64_t> ids;      // [sum(lengths)]
  std::vector<float> weights;    // [sum(lengths)] for weighted features, else empty
};

struct Request {
  int64_t batch_size = 0;
  std::map<std::string, Feature> sparse;  // by feature name
  std::vector<float> dense;               // row-major [batch_size, num_dense]
  int64_t dense_rows = 0;
  int64_t dense_cols = 0;
};

struct Output {
  std::vector<int64_t> shape;  // shape[0] is the batch
  std::vector<float> values;   // row-major
};

// A request that passed validation, laid out as the model's inputs (Model::prepare). Requests prepared
// for one Model can run together in one forward (Model::predict_batch): how a server batches them.
struct Prepared {
  int64_t batch_size = 0;
  std::vector<int32_t> lengths;      // [features x batch_size], feature-major (Model::feature_names order)
  std::vector<int64_t> ids;          // [sum(lengths)], feature-major, after the id policy (modulo ids folded)
  std::vector<int64_t> feature_ids;  // [features]: how many of ids each feature has
  std::vector<float> weights;        // [sum(lengths)] for a weighted model (1 for unweighted features), else empty
  std::vector<float> dense;          // row-major [batch_size, num_dense]
};

// A model's outputs in the order the model returns them.
using NamedOutputs = std::vector<std::pair<std::string, Output>>;

struct LoadOptions {
  std::string fbgemm_dir;      // folder of fbgemm_gpu's .so files; empty: $RECSHIP_FBGEMM_DIR, else the one recorded at build time
  bool check_versions = true;  // refuse an artifact built with another torch / fbgemm_gpu version
  bool self_check = true;      // run the artifact's sample and compare with its recorded outputs
  int64_t max_batch_size = rules::kMaxBatchSizeDefault;  // larger requests are refused with InvalidRequest (the server's --max-batch-size)
  // Which model to run: "torchscript" (model.pt), "aoti" (model.pt2; ArtifactError where the artifact has none,
  // it was compiled by another torch, or this CPU lacks its target ISA) or "auto" (model.pt2 where it runs here,
  // else model.pt). Both take the same requests and give the same outputs.
  std::string format = "auto";
  // sha256s (lowercase hex) of the manifest.json files allowed to load; unset: any. A listed manifest pins every
  // file of the artifact through its checksums (recship serve --trusted-sha256, export/artifact.py open_artifact).
  std::optional<std::set<std::string>> trusted;
};

// Intra-op threads of the forwards the calling thread runs (torch keeps the setting per thread).
void set_intra_op_threads(int threads);

class Model {
 public:
  // Verifies the artifact as a unit, then loads it, in the artifact contract's open order (recship/contract/__init__.py,
  // steps 1-8, which Python's open_artifact keeps too), each failure an ArtifactError naming the file in the same
  // words; the model (LoadOptions::format) loads from the verified bytes with tables.bin mapped copy-on-write (a
  // format 1 artifact keeps its tables inside the model file), then (by default) runs the sample self-check. The
  // tables stay mapped while the Model lives.
  static std::unique_ptr<Model> load(const std::string& artifact_dir, const LoadOptions& options = {});
  ~Model();

  // Validates and runs one request; safe to call from many threads on one Model.
  std::map<std::string, Output> predict(const Request& request) const;
  // Validates one request (InvalidRequest, the same rules and messages as predict) without running it.
  Prepared prepare(const Request& request) const;
  // One forward over requests prepared by this Model, concatenated along the batch (at most max_batch_size
  // examples together); each request gets exactly its own rows back, in the order given.
  std::vector<NamedOutputs> predict_batch(const std::vector<const Prepared*>& requests) const;
  // Median milliseconds of the model's forward alone, inputs built once (to measure predict's overhead).
  double forward_ms(const Request& request, int runs) const;

  const std::vector<std::string>& feature_names() const;
  int64_t num_dense() const;
  int64_t max_batch_size() const;
  // The artifact's sample request and its recorded outputs, read and verified as Model::load does (ArtifactError).
  Request sample_request() const;
  std::map<std::string, Output> sample_outputs() const;
  // The model that runs: "torchscript" (model.pt) or "aoti" (model.pt2).
  const std::string& format() const;
  // Why "auto" left the artifact's model.pt2 unused (e.g. "model.pt2 targets x86-64-v4; this CPU lacks avx512f");
  // empty when model.pt2 runs, the artifact has none, or the format was asked for explicitly.
  const std::string& format_note() const;

 private:
  Model();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Python's repr() of a str ('t_cat_0@0'), as recship's messages show names and files; cut to `limit` characters
// (code points) with "... (N characters)" after, as serving/requests.py shown() shows what a client sent.
std::string py_repr(const std::string& text, size_t limit = std::string::npos);

}  // namespace recship
