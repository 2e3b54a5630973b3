// The manifest's JSON Schema (recship/contract/manifest.schema.json, embedded at build by CMake) interpreted: every way
// a manifest breaks it, as recship/contract/schema.py reports it with jsonschema (same order, same words).
//
// The interpreter knows exactly the keywords the file uses (kKeywords); it refuses a schema with any other one (at the
// first check, so every loader test fails), rather than ignoring a rule.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace recship::schema {

// One step of a path into a manifest: an object key, or an array index.
struct Token {
  std::string key;
  bool is_index = false;
  size_t index = 0;
};
using Where = std::vector<Token>;

// Tokens compare as schema.py's sort key: indices as numbers, keys as strings (UTF-8 bytes: code point order).
inline bool operator<(const Token& a, const Token& b) {
  if (a.is_index != b.is_index) return a.is_index;
  return a.is_index ? a.index < b.index : a.key < b.key;
}
inline bool operator==(const Token& a, const Token& b) { return a.is_index == b.is_index && a.index == b.index && a.key == b.key; }

// One way a manifest breaks the contract (recship/contract/schema.py Problem): the field it names, the rule (a schema
// keyword, or a rule of manifest.cpp check_rules), and the message users read.
struct Problem {
  Where where;
  std::string rule;
  std::string message;

  std::string pointer() const;  // where as a JSON Pointer: "/sparse_features/0/rows"
};

// Every way `manifest` breaks the schema, sorted as schema.py sorts them (field by field, indices as numbers, then
// rule, then message); empty: it conforms.
std::vector<Problem> problems(const nlohmann::json& manifest);

// A field's name as messages print it: "sparse_features[0].rows", "outputs['logit'].shape"; "" for the manifest.
std::string field(const Where& where);

// "<field> <text>", or text alone for the manifest itself.
std::string said(const Where& where, const std::string& text);

// The Python type json.loads gives a JSON value ("int", "str", "dict", ...): the messages name it.
const char* python_type(const nlohmann::json& v);

}  // namespace recship::schema
