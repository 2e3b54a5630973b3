// The command lines of recship's tools (recship_front, recship_predict, recship_load): flags that each take one
// value (--name VALUE), bound to variables. A parse stops at the first problem and says what it was, which flag
// and which value, so that each tool words it as it always has.
//
// Numbers are read whole ("5" but not "5x" or "", as strtoll and strtod read them: leading blanks and a sign are
// fine); a flag given twice keeps its last value, except a list (Flags::texts), which keeps them all.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

namespace recship::args {

// Whether -h or --help is anywhere on the command line.
bool wants_help(int argc, char** argv);

struct Problem {
  enum class Kind {
    kNone,
    kMissingValue,  // the last word is a flag (known or not) with nothing after it
    kUnknown,       // not a flag of this tool
    kNotANumber,    // a numeric flag's value does not read as one
    kOutOfRange,    // a whole number outside the flag's [lo, hi]
  };
  Kind kind = Kind::kNone;
  std::string flag, value;
  int64_t lo = 0, hi = 0;  // a whole-number flag's range (for kNotANumber and kOutOfRange)

  explicit operator bool() const { return kind != Kind::kNone; }
};

class Flags {
 public:
  Flags& text(const std::string& name, std::string* out);
  Flags& texts(const std::string& name, std::vector<std::string>* out);
  Flags& integer(const std::string& name, int64_t* out, int64_t lo = std::numeric_limits<int64_t>::min(),
                 int64_t hi = std::numeric_limits<int64_t>::max());
  Flags& integer(const std::string& name, int* out, int64_t lo = std::numeric_limits<int>::min(),
                 int64_t hi = std::numeric_limits<int>::max());
  Flags& number(const std::string& name, double* out);

  // Reads argv[first], argv[first + 1], ... as flag-value pairs; the first problem, or none.
  Problem parse(int argc, char** argv, int first = 1) const;

 private:
  struct Flag {
    std::function<Problem::Kind(const std::string&)> set;  // stores the value, or says what is wrong with it
    int64_t lo = 0, hi = 0;
  };
  std::map<std::string, Flag> flags_;
};

}  // namespace recship::args
