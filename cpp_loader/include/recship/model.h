// recship C++ loader: run an exported recship artifact (model.pt + manifest.json + sample/) without Python.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace recship {

// Every error the library throws derives from Error; the subclasses say what went wrong.
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct InvalidRequest : Error {  // the request does not fit the model (same rules and messages as the server)
  using Error::Error;
};
struct ArtifactError : Error {  // missing files, bad checksum, failed sample self-check
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

struct LoadOptions {
  std::string fbgemm_dir;      // folder of fbgemm_gpu's .so files; empty: the one recorded at build time
  bool check_versions = true;  // refuse an artifact built with another torch / fbgemm_gpu version
  bool self_check = true;      // run the artifact's sample and compare with its recorded outputs
  int64_t max_batch_size = 512;  // larger requests are refused with InvalidRequest (the server's --max-batch-size)
};

class Model {
 public:
  // Reads manifest.json, verifies model.pt's sha256, loads the op libraries, loads the
  // TorchScript module and (by default) runs the sample self-check.
  static std::unique_ptr<Model> load(const std::string& artifact_dir, const LoadOptions& options = {});
  ~Model();

  // Validates and runs one request; safe to call from many threads on one Model.
  std::map<std::string, Output> predict(const Request& request) const;
  // Median milliseconds of the module's forward alone, inputs built once (to measure predict's overhead).
  double forward_ms(const Request& request, int runs) const;

  const std::vector<std::string>& feature_names() const;
  int64_t num_dense() const;
  Request sample_request() const;
  std::map<std::string, Output> sample_outputs() const;

 private:
  Model();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace recship
