// A production binary in a few lines: load an artifact once, predict by feature name.
#include <iostream>

#include "recship/model.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: recship_example ARTIFACT_DIR\n";
    return 2;
  }
  try {
    auto model = recship::Model::load(argv[1]);  // checksum, op libraries, sample self-check
    recship::Request request = model->sample_request();
    for (const auto& [name, output] : model->predict(request))
      std::cout << name << "[0] = " << output.values.at(0) << "\n";
  } catch (const recship::Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
