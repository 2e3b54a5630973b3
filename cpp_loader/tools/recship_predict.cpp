// recship_predict ARTIFACT_DIR [--request FILE] [--bench N] [--format F]: run an artifact from C++ and print its outputs.
#include <algorithm>
#include <atomic>
#include <thread>
#include <chrono>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "recship/model.h"

using json = nlohmann::json;

static recship::Request from_json(const json& body, const recship::Model& model) {
  // the request format of `recship predict`: {"sparse": {"f": [[ids], ...]}, "dense": [[...]], "weights": {...}}
  recship::Request r;
  for (const auto& [name, rows] : body.at("sparse").items()) {
    recship::Feature f;
    for (const auto& row : rows) {
      f.lengths.push_back(static_cast<int32_t>(row.size()));
      for (const auto& id : row) f.ids.push_back(id.get<int64_t>());
    }
    if (body.contains("weights") && body["weights"].contains(name))
      for (const auto& row : body["weights"][name])
        for (const auto& w : row) f.weights.push_back(w.get<float>());
    r.batch_size = static_cast<int64_t>(f.lengths.size());
    r.sparse[name] = std::move(f);
  }
  if (body.contains("dense")) {
    for (const auto& row : body["dense"]) {
      r.dense_cols = static_cast<int64_t>(row.size());
      for (const auto& x : row) r.dense.push_back(x.get<float>());
      ++r.dense_rows;
    }
  }
  (void)model;
  return r;
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

static const char* kUsage =
    "usage: recship_predict ARTIFACT_DIR [--request FILE] [--bench N] [--threads T] [--format F] [--fbgemm-dir DIR] [--max-batch-size B]\n"
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
    "  --fbgemm-dir DIR    where fbgemm_gpu's op libraries are (default: the folder the loader was built with)\n"
    "  --max-batch-size B  largest batch a request may have (default 512)\n"
    "  -h, --help          print this and exit\n"
    "\n"
    "Exit codes: 0 ok, 1 the artifact cannot be loaded or run, 2 bad arguments or an invalid request.\n";

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::cout << kUsage;
      return 0;
    }
  }
  if (argc < 2) {
    std::cerr << kUsage;
    return 2;
  }
  std::string artifact = argv[1], request_file, fbgemm_dir, format = "auto";
  int bench = 0, threads = 0;
  int64_t max_batch_size = 512;
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--request" && i + 1 < argc) request_file = argv[++i];
    else if (a == "--bench" && i + 1 < argc) bench = std::stoi(argv[++i]);
    else if (a == "--fbgemm-dir" && i + 1 < argc) fbgemm_dir = argv[++i];
    else if (a == "--threads" && i + 1 < argc) threads = std::stoi(argv[++i]);
    else if (a == "--format" && i + 1 < argc) format = argv[++i];
    else if (a == "--max-batch-size" && i + 1 < argc) max_batch_size = std::stoll(argv[++i]);
    else {
      std::cerr << "recship_predict: error: unknown argument " << a << "\n";
      return 2;
    }
  }
  if (format != "auto" && format != "torchscript" && format != "aoti") {
    std::cerr << "recship_predict: error: --format must be auto, torchscript or aoti, got " << format << "\n";
    return 2;
  }
  try {
    recship::LoadOptions options;
    options.fbgemm_dir = fbgemm_dir;
    options.max_batch_size = max_batch_size;
    options.format = format;
    auto model = recship::Model::load(artifact, options);
    const std::string loaded = model->format() == "aoti" ? "aoti (model.pt2)" : "torchscript (model.pt)";
    if (!model->format_note().empty()) std::cerr << "recship_predict: note: running model.pt: " << model->format_note() << "\n";
    recship::Request request = model->sample_request();
    if (!request_file.empty()) {
      std::ifstream in(request_file);
      if (!in) throw recship::Error("request file not found: " + request_file);
      request = from_json(json::parse(in), *model);
    }
    auto outputs = model->predict(request);
    json out;
    for (const auto& [name, o] : outputs) {
      json rows = json::array();
      size_t width = o.values.size() / std::max<int64_t>(1, o.shape[0]);
      for (int64_t b = 0; b < o.shape[0]; ++b)
        rows.push_back(std::vector<float>(o.values.begin() + b * width, o.values.begin() + (b + 1) * width));
      out[name] = rows;
    }
    std::cout << out.dump() << std::endl;
    if (threads > 0) {
      bool ok = check_threads(*model, request, threads);
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
      double raw = model->forward_ms(request, bench);
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
