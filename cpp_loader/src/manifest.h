// The manifest of an artifact checked as export/manifest.py check_manifest checks it, with its words (the field
// named, "is missing", "must be int, got str"), and the Python-style formatting its messages share with model.cpp.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <type_traits>
#include <vector>

#include "tables.h"

namespace recship {

extern const std::string kFormat;    // "recship.artifact/2": the tables in tables.bin (export/tables.py)
extern const std::string kFormatV1;  // "recship.artifact/1": the tables inside model.pt / model.pt2: still loaded
// The largest id_bound a feature may have: every int64 id but INT64_MAX (export/manifest.py MAX_ID_BOUND).
constexpr uint64_t kMaxIdBound = 9223372036854775807ULL;

// Throws ArtifactError "<file>: <what>" naming the first field that breaks the contract: the required fields of
// protos/recship/artifact/v1/manifest.schema.json with their JSON types (tests/cpp_loader checks this against the
// schema), then their values, the sample's tensors as one request of this model, each feature's rows as tables.bin
// holds its table's, model.pt2's description.
void check_manifest(const nlohmann::json& m, const std::string& file);

// Python's repr of a list of ints / of strs: "[4, 13]", "['logit', 'prob']".
template <typename T>
inline std::string py_list(const std::vector<T>& items) {
  std::string out = "[";
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += ", ";
    if constexpr (std::is_same_v<T, std::string>) out += tables::py_repr(items[i]);
    else out += std::to_string(items[i]);
  }
  return out + "]";
}

// An unsigned 128-bit integer in decimal.
inline std::string to_string128(unsigned __int128 v) {
  std::string out;
  do {
    out.insert(out.begin(), static_cast<char>('0' + static_cast<int>(v % 10)));
    v /= 10;
  } while (v);
  return out;
}

}  // namespace recship
