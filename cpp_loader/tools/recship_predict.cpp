// recship_predict ARTIFACT_DIR [--request FILE] [--bench N] [--format F]: run an artifact from C++ and print its outputs.
#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <iostream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <thread>

#include "args.h"
#include "recship/model.h"

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;  // a request's keys in the file's order, as Python's json reads them

// serving/requests.py shown(): Python's repr() of a client's string, cut to 64 characters (code points).
static std::string shown(const std::string& text) { return recship::py_repr(text, 64); }

// The Python type json.loads gives a JSON value (the REST front's messages name them).
static const char* python_type(const ordered_json& v) {
  switch (v.type()) {
    case ordered_json::value_t::null: return "NoneType";
    case ordered_json::value_t::boolean: return "bool";
    case ordered_json::value_t::number_integer:
    case ordered_json::value_t::number_unsigned: return "int";
    case ordered_json::value_t::number_float: return "float";
    case ordered_json::value_t::string: return "str";
    case ordered_json::value_t::array: return "list";
    default: return "dict";
  }
}

// The REST front's check of one KServe input's JSON data (serving/rest.py _data), with its words: INT64 takes JSON
// integers only (no 1.5, 1e30, "1" or true), FP32 integers or floats (no booleans); nothing is truncated or
// coerced. `input` is the KServe input the values would be: <feature>.values, <feature>.weights or dense.
// (One difference: an integer literal past uint64, which nlohmann reads as a float, is "found float" here
// where Python's json reads an int "outside INT64's range"; both are refused.)
static void check_data(const std::string& input, bool int64, const std::vector<const ordered_json*>& values) {
  std::set<std::string> wrong;
  for (const ordered_json* v : values) {
    const bool ok = v->is_number_integer() || (!int64 && v->is_number_float());
    if (!ok) wrong.insert(python_type(*v));
  }
  const std::string datatype = int64 ? "INT64" : "FP32";
  if (!wrong.empty()) {
    std::string found;
    for (const auto& w : wrong) found += (found.empty() ? "" : ", ") + w;
    throw recship::InvalidRequest("input " + shown(input) + ": " + datatype + " data must be " + (int64 ? "ints" : "float or ints") +
                                  ", found " + found);
  }
  if (int64)
    for (const ordered_json* v : values)
      if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
        throw recship::InvalidRequest("input " + shown(input) + ": a value is outside INT64's range");
}

// A JSON number as float32 as numpy casts it: out of float's range is +-inf (a plain cast would be undefined),
// which validation then refuses as not finite.
static float to_float(const ordered_json& v) {
  const double d = v.get<double>();
  if (d > std::numeric_limits<float>::max()) return std::numeric_limits<float>::infinity();
  if (d < -std::numeric_limits<float>::max()) return -std::numeric_limits<float>::infinity();
  return static_cast<float>(d);
}

// The values of a list of lists ([[...], ...]: one list per example or dense row), flattened; their row sizes.
static std::vector<const ordered_json*> rows_of(const ordered_json& node, const std::string& what, std::vector<int32_t>* sizes) {
  if (!node.is_array()) throw recship::InvalidRequest(what);
  std::vector<const ordered_json*> out;
  for (const auto& row : node) {
    if (!row.is_array()) throw recship::InvalidRequest(what);
    if (row.size() > static_cast<size_t>(INT32_MAX)) throw recship::InvalidRequest(what);
    sizes->push_back(static_cast<int32_t>(row.size()));
    for (const auto& x : row) out.push_back(&x);
  }
  return out;
}

static recship::Request from_json(const ordered_json& body) {
  // the request format of `recship predict`: {"sparse": {"f": [[ids], ...]}, "dense": [[...]], "weights": {...}}
  if (!body.is_object() || !body.contains("sparse") || !body["sparse"].is_object())
    throw recship::InvalidRequest("the request must be a JSON object with a \"sparse\" object");
  for (const auto& [key, _] : body.items())
    if (key != "sparse" && key != "dense" && key != "weights")
      throw recship::InvalidRequest("unknown key " + shown(key) + " in the request: it takes \"sparse\", \"dense\" and \"weights\"");
  const ordered_json no_weights = ordered_json::object();
  const ordered_json& weights = body.contains("weights") ? body["weights"] : no_weights;
  if (!weights.is_object()) throw recship::InvalidRequest("\"weights\" must be an object of features, like \"sparse\"");
  for (const auto& [name, _] : weights.items())
    if (!body["sparse"].contains(name)) throw recship::InvalidRequest("weights for " + shown(name) + ", which \"sparse\" does not have");
  recship::Request r;
  bool first = true;
  for (const auto& [name, rows] : body["sparse"].items()) {
    recship::Feature f;
    const auto ids = rows_of(rows, "sparse feature " + shown(name) + " must be a list of examples, each a list of ids", &f.lengths);
    check_data(name + ".values", true, ids);
    for (const ordered_json* id : ids) f.ids.push_back(id->get<int64_t>());
    if (weights.contains(name)) {
      std::vector<int32_t> sizes;
      const auto w = rows_of(weights[name], "weights of " + shown(name) + " must be a list of examples, each a list of weights", &sizes);
      check_data(name + ".weights", false, w);
      for (const ordered_json* x : w) f.weights.push_back(to_float(*x));
    }
    if (first) r.batch_size = static_cast<int64_t>(f.lengths.size());  // the first feature's, as PredictClient.request
    first = false;
    r.sparse[name] = std::move(f);
  }
  if (body.contains("dense")) {
    std::vector<int32_t> sizes;
    const auto values = rows_of(body["dense"], "\"dense\" must be a list of rows, each a list of numbers", &sizes);
    check_data("dense", false, values);
    for (const ordered_json* x : values) r.dense.push_back(to_float(*x));
    r.dense_rows = static_cast<int64_t>(sizes.size());
    r.dense_cols = sizes.empty() ? 0 : sizes[0];
    for (size_t i = 1; i < sizes.size(); ++i)
      if (sizes[i] != sizes[0])
        throw recship::InvalidRequest("dense rows must all have the same length: row 0 has " + std::to_string(sizes[0]) +
                                      " values, row " + std::to_string(i) + " has " + std::to_string(sizes[i]));
  }
  return r;
}

static ordered_json parse_request(std::istream& in, const std::string& file) {
  try {
    return ordered_json::parse(in);
  } catch (const ordered_json::parse_error& e) {
    throw recship::InvalidRequest("the request file " + file + " is not JSON: " + e.what());
  } catch (const std::ios_base::failure& e) {  // e.g. a directory
    throw recship::InvalidRequest("the request file " + file + " cannot be read: " + e.what());
  }
}

// Example b of a request, as a batch of one.
static recship::Request one_example(const recship::Request& r, int64_t b) {
  recship::Request out;
  out.batch_size = 1;
  for (const auto& [name, f] : r.sparse) {
    int64_t start = 0;
    for (int64_t i = 0; i < b; ++i) start += f.lengths[i];
    recship::Feature g;
    g.lengths = {f.lengths[b]};
    g.ids.assign(f.ids.begin() + start, f.ids.begin() + start + f.lengths[b]);
    if (!f.weights.empty()) g.weights.assign(f.weights.begin() + start, f.weights.begin() + start + f.lengths[b]);
    out.sparse[name] = std::move(g);
  }
  if (r.dense_cols > 0) {
    out.dense.assign(r.dense.begin() + b * r.dense_cols, r.dense.begin() + (b + 1) * r.dense_cols);
    out.dense_rows = 1;
    out.dense_cols = r.dense_cols;
  }
  return out;
}

// T threads, each predicting its own example 50 times, must all get the single-threaded answers.
static bool check_threads(const recship::Model& model, const recship::Request& r, int threads) {
  std::vector<recship::Request> requests;
  std::vector<std::map<std::string, recship::Output>> expected;
  for (int t = 0; t < threads; ++t) {
    requests.push_back(one_example(r, t % r.batch_size));
    expected.push_back(model.predict(requests.back()));
  }
  std::atomic<int> wrong{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      for (int i = 0; i < 50; ++i) {
        auto got = model.predict(requests[t]);
        for (const auto& [name, o] : expected[t])
          if (got.at(name).values != o.values) ++wrong;
      }
    });
  for (auto& th : pool) th.join();
  return wrong == 0;
}

static double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

// The allow-list file of `recship serve --trusted-sha256` (serving/repository.py read_trusted, its words): one
// manifest.json sha256 per line, the first word of each (sha256sum's output works), # comments. false: error says why.
static bool read_trusted(const std::string& path, std::set<std::string>* out, std::string* error) {
  std::ifstream in(path);
  if (!in) {
    *error = path + ": cannot be read";
    return false;
  }
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    std::istringstream words(line.substr(0, line.find('#')));
    std::string word;
    if (!(words >> word)) continue;
    bool hex = word.size() == 64;
    for (char& c : word) {
      hex = hex && std::isxdigit(static_cast<unsigned char>(c));
      c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    }
    if (!hex) {
      *error = path + ":" + std::to_string(number) + ": not a sha256: " + shown(word);
      return false;
    }
    out->insert(word);
  }
  return true;
}

static std::string usage() {
  return
    "usage: recship_predict ARTIFACT_DIR [--request FILE] [--bench N] [--threads T] [--format F] [--fbgemm-dir DIR] [--max-batch-size B]\n"
    "                       [--trusted-sha256 FILE]\n"
    "\n"
    "Runs an exported recship artifact from C++ and prints its outputs as JSON.\n"
    "\n"
    "  ARTIFACT_DIR        the folder `recship export` wrote (manifest.json, model.pt, model.pt2, sample/)\n"
    "  --request FILE      JSON {\"sparse\": {\"f\": [[1, 2], [3]]}, \"dense\": [[...]], \"weights\": {...}};\n"
    "                      default: the artifact's own sample request\n"
    "  --bench N           time N predictions of the request; format, p50/p90/p99 and the raw forward on stderr\n"
    "  --threads T         also run the sample from T threads at once, each checking its answer\n"
    "  --format F          auto (default: model.pt2 where the artifact has one that runs here, else model.pt),\n"
    "                      torchscript (model.pt) or aoti (model.pt2, refused where it cannot run)\n"
    "  --fbgemm-dir DIR    where fbgemm_gpu's op libraries are (default: $RECSHIP_FBGEMM_DIR, else the folder the\n"
    "                      loader was built with; the recship_predict console script sets RECSHIP_FBGEMM_DIR)\n"
    "  --max-batch-size B  largest batch a request may have (default " + std::to_string(recship::rules::kMaxBatchSizeDefault) + ")\n"
    "  --trusted-sha256 FILE  allow-list of manifest.json sha256s, as recship serve's (sha256sum output works);\n"
    "                      an artifact whose manifest is not listed is refused (default: any artifact loads)\n"
    "  -h, --help          print this and exit\n"
    "\n"
    "Exit codes: 0 ok, 1 the artifact cannot be loaded or run, 2 bad arguments or an invalid request.\n";
}

int main(int argc, char** argv) {
  if (recship::args::wants_help(argc, argv)) {
    std::cout << usage();
    return 0;
  }
  if (argc < 2) {
    std::cerr << usage();
    return 2;
  }
  std::string artifact = argv[1], request_file, fbgemm_dir, format = "auto", trusted_file;
  int64_t bench = 0, threads = 0, max_batch_size = recship::rules::kMaxBatchSizeDefault;
  recship::args::Flags flags;
  flags.text("--request", &request_file).text("--fbgemm-dir", &fbgemm_dir).text("--format", &format);
  flags.text("--trusted-sha256", &trusted_file);
  flags.integer("--bench", &bench, 0, INT32_MAX).integer("--threads", &threads, 0, 4096);
  flags.integer("--max-batch-size", &max_batch_size, 1, INT32_MAX);
  if (const recship::args::Problem p = flags.parse(argc, argv, 2)) {
    using Kind = recship::args::Problem::Kind;
    if (p.kind == Kind::kNotANumber || p.kind == Kind::kOutOfRange)
      std::cerr << "recship_predict: error: " << p.flag << " takes a whole number from " << p.lo << " to " << p.hi << ", got " << p.value << "\n";
    else
      std::cerr << "recship_predict: error: unknown argument " << p.flag << "\n";
    return 2;
  }
  if (format != "auto" && format != "torchscript" && format != "aoti") {
    std::cerr << "recship_predict: error: --format must be auto, torchscript or aoti, got " << format << "\n";
    return 2;
  }
  std::set<std::string> trusted;
  std::string trusted_error;
  if (!trusted_file.empty() && !read_trusted(trusted_file, &trusted, &trusted_error)) {
    std::cerr << "recship_predict: error: --trusted-sha256: " << trusted_error << "\n";
    return 2;
  }
  try {
    recship::LoadOptions options;
    if (!trusted_file.empty()) options.trusted = trusted;
    options.fbgemm_dir = fbgemm_dir;
    options.max_batch_size = max_batch_size;
    options.format = format;
    // the request file first: a missing or malformed one is exit code 2 naming the file, before the model loads
    std::optional<recship::Request> given;
    if (!request_file.empty()) {
      std::ifstream in(request_file);
      if (!in) throw recship::InvalidRequest("the request file " + request_file + " cannot be read: " + std::strerror(errno));
      const ordered_json body = parse_request(in, request_file);
      try {
        given = from_json(body);  // its refusals are in the REST front's words
      } catch (const ordered_json::exception& e) {
        throw recship::InvalidRequest("the request file " + request_file + ": " + e.what());
      }
    }
    auto model = recship::Model::load(artifact, options);
    const std::string loaded = model->format() == "aoti" ? "aoti (model.pt2)" : "torchscript (model.pt)";
    if (!model->format_note().empty()) std::cerr << "recship_predict: note: running model.pt: " << model->format_note() << "\n";
    recship::Request request = given ? std::move(*given) : model->sample_request();
    auto outputs = model->predict(request);
    json out;
    for (const auto& [name, o] : outputs) {
      json rows = json::array();
      const int64_t batch = o.shape.empty() ? 1 : o.shape[0];  // a 0-d output: one row of one value
      size_t width = o.values.size() / std::max<int64_t>(1, batch);
      for (int64_t b = 0; b < batch; ++b)
        rows.push_back(std::vector<float>(o.values.begin() + b * width, o.values.begin() + (b + 1) * width));
      out[name] = rows;
    }
    std::cout << out.dump() << std::endl;
    if (threads > 0) {
      bool ok = check_threads(*model, request, static_cast<int>(threads));
      std::cerr << (ok ? "threads ok: " : "threads FAILED: ") << threads << " threads got their own answers from " << loaded << "\n";
      if (!ok) return 1;
    }
    if (bench > 0) {
      std::vector<double> full;
      for (int i = 0; i < bench; ++i) {
        auto t0 = std::chrono::steady_clock::now();
        model->predict(request);
        full.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      }
      double raw = model->forward_ms(request, static_cast<int>(bench));
      double p50 = percentile(full, 0.5);
      std::cerr << loaded << ", batch " << request.batch_size << ", " << bench << " runs: predict p50 " << p50 << " ms, p90 "
                << percentile(full, 0.9) << " ms, p99 " << percentile(full, 0.99) << " ms; raw forward p50 " << raw
                << " ms; overhead " << (raw > 0 ? (p50 / raw - 1) * 100 : 0) << "%\n";
    }
  } catch (const recship::InvalidRequest& e) {
    std::cerr << "recship_predict: invalid request: " << e.what() << "\n";
    return 2;
  } catch (const recship::Error& e) {
    std::cerr << "recship_predict: error: " << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "recship_predict: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
