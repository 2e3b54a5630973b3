#include "args.h"

#include <cerrno>
#include <cstdlib>

namespace recship::args {

using Kind = Problem::Kind;

bool wants_help(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") return true;
  }
  return false;
}

namespace {

Kind read_integer(const std::string& text, int64_t lo, int64_t hi, int64_t* out) {
  if (text.empty()) return Kind::kNotANumber;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (*end != '\0' || end == text.c_str()) return Kind::kNotANumber;
  if (errno == ERANGE || v < lo || v > hi) return Kind::kOutOfRange;
  *out = v;
  return Kind::kNone;
}

}  // namespace

Flags& Flags::text(const std::string& name, std::string* out) {
  flags_[name] = {[out](const std::string& v) {
                    *out = v;
                    return Kind::kNone;
                  }};
  return *this;
}

Flags& Flags::texts(const std::string& name, std::vector<std::string>* out) {
  flags_[name] = {[out](const std::string& v) {
                    out->push_back(v);
                    return Kind::kNone;
                  }};
  return *this;
}

Flags& Flags::integer(const std::string& name, int64_t* out, int64_t lo, int64_t hi) {
  flags_[name] = {[out, lo, hi](const std::string& v) { return read_integer(v, lo, hi, out); }, lo, hi};
  return *this;
}

Flags& Flags::integer(const std::string& name, int* out, int64_t lo, int64_t hi) {
  flags_[name] = {[out, lo, hi](const std::string& v) {
                    int64_t wide = 0;
                    const Kind kind = read_integer(v, lo, hi, &wide);
                    if (kind == Kind::kNone) *out = static_cast<int>(wide);
                    return kind;
                  },
                  lo, hi};
  return *this;
}

Flags& Flags::number(const std::string& name, double* out) {
  flags_[name] = {[out](const std::string& v) {
                    if (v.empty()) return Kind::kNotANumber;
                    char* end = nullptr;
                    errno = 0;
                    const double d = std::strtod(v.c_str(), &end);
                    if (*end != '\0' || end == v.c_str() || errno == ERANGE) return Kind::kNotANumber;
                    *out = d;
                    return Kind::kNone;
                  }};
  return *this;
}

Problem Flags::parse(int argc, char** argv, int first) const {
  for (int i = first; i < argc; i += 2) {
    Problem p;
    p.flag = argv[i];
    if (i + 1 >= argc) {
      p.kind = Kind::kMissingValue;
      return p;
    }
    p.value = argv[i + 1];
    const auto flag = flags_.find(p.flag);
    if (flag == flags_.end()) {
      p.kind = Kind::kUnknown;
      return p;
    }
    p.kind = flag->second.set(p.value);
    if (p) {
      p.lo = flag->second.lo;
      p.hi = flag->second.hi;
      return p;
    }
  }
  return {};
}

}  // namespace recship::args
