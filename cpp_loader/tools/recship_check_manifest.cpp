// recship_check_manifest FILE...: each manifest.json's answer to the artifact contract, as the C++ loader gives it.
//
// Prints one JSON line per file: {"file": FILE, "problems": [{"pointer", "rule", "message"}, ...], "error": the
// ArtifactError Model::load would raise, or null}. tests/contract runs it on the shared vectors and holds its answers
// to recship/contract's (Python). Exit codes: 0 every file was read (accepted or not), 2 one could not be read or parsed.
#include <fstream>
#include <iostream>
#include <sstream>

#include "manifest.h"

using json = nlohmann::json;

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "-h" || std::string(argv[1]) == "--help") {
    std::cout << "usage: recship_check_manifest FILE...\n";
    return argc < 2 ? 2 : 0;
  }
  for (int i = 1; i < argc; ++i) {
    std::ifstream in(argv[i], std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    json manifest;
    try {
      if (!in) throw std::runtime_error("cannot be read");
      manifest = json::parse(text.str());
    } catch (const std::exception& e) {
      std::cerr << argv[i] << ": " << e.what() << "\n";
      return 2;
    }
    json problems = json::array();
    for (const auto& p : recship::contract_problems(manifest))
      problems.push_back({{"pointer", p.pointer()}, {"rule", p.rule}, {"message", p.message}});
    json error = nullptr;
    try {
      recship::check_manifest(manifest, argv[i]);
    } catch (const recship::ArtifactError& e) {
      error = e.what();
    }
    std::cout << json{{"file", argv[i]}, {"problems", problems}, {"error", error}}.dump() << "\n";
  }
  return 0;
}
