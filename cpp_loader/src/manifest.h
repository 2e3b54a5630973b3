// The manifest of an artifact checked as recship/contract checks it: recship/contract/manifest.schema.json (interpreted
// by schema.cpp), then the rules between fields (recship/contract/rules.py), in the same order and words; and the
// Python-style formatting its messages share with model.cpp.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <type_traits>
#include <vector>

#include "schema.h"
#include "recship/model.h"

namespace recship {

// Every way the manifest m breaks the contract: the schema's problems (sorted), or else the first rule it breaks;
// empty: it keeps the contract. What tests/contract's vectors hold both loaders to.
std::vector<schema::Problem> contract_problems(const nlohmann::json& m);

// Throws ArtifactError "<file>: <what>" naming the first field that breaks the contract (contract_problems), and how
// many more problems there are.
void check_manifest(const nlohmann::json& m, const std::string& file);

// Python's repr of a list of ints / of strs: "[4, 13]", "['logit', 'prob']".
template <typename T>
inline std::string py_list(const std::vector<T>& items) {
  std::string out = "[";
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += ", ";
    if constexpr (std::is_same_v<T, std::string>) out += py_repr(items[i]);
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
