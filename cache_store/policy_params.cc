#include "cache_store/policy_params.h"

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cache_store/quote.h"

namespace kvkeep {

const std::string* ParamReader::Find(absl::string_view key) {
  used_.emplace(key);
  auto it = spec_.params.find(std::string(key));
  return it == spec_.params.end() ? nullptr : &it->second;
}

void ParamReader::Fail(std::string message) {
  if (error_.ok()) {
    error_ = absl::InvalidArgumentError(
        absl::StrCat("policy '", spec_.name, "': ", message));
  }
}

int64_t ParamReader::Int(absl::string_view key, int64_t def, int64_t lo,
                         int64_t hi) {
  const std::string* text = Find(key);
  if (text == nullptr) return def;
  int64_t v;
  if (!absl::SimpleAtoi(*text, &v)) {
    Fail(absl::StrCat(key, " = ", Quote(*text), " is not an integer"));
    return def;
  }
  if (v < lo || v > hi) {
    Fail(absl::StrCat(key, " = ", v, " is outside [", lo, ", ", hi, "]"));
    return def;
  }
  return v;
}

double ParamReader::Double(absl::string_view key, double def, double lo,
                           double hi) {
  const std::string* text = Find(key);
  if (text == nullptr) return def;
  double v;
  if (!absl::SimpleAtod(*text, &v) || !(v >= lo && v <= hi)) {
    Fail(absl::StrCat(key, " = ", Quote(*text), " is not a number in [", lo,
                      ", ", hi, "]"));
    return def;
  }
  return v;
}

std::string ParamReader::Choice(
    absl::string_view key, absl::string_view def,
    std::initializer_list<absl::string_view> choices) {
  const std::string* text = Find(key);
  if (text == nullptr) return std::string(def);
  for (absl::string_view c : choices) {
    if (*text == c) return *text;
  }
  Fail(absl::StrCat(key, " = ", Quote(*text), " is not one of ",
                    absl::StrJoin(choices, ", ")));
  return std::string(def);
}

const ParamSpec* ParamReader::Known(absl::string_view key, ParamType type) {
  for (const ParamSpec& p : known_) {
    if (p.name == key && p.type == type) return &p;
  }
  if (error_.ok()) {
    error_ = absl::InternalError(
        absl::StrCat("policy '", spec_.name, "' reads parameter '", key,
                     "', which its table does not list with that type"));
  }
  return nullptr;
}

int64_t ParamReader::Int(absl::string_view key) {
  const ParamSpec* p = Known(key, ParamType::kInt);
  int64_t def = 0;
  if (p == nullptr) return def;
  if (!absl::SimpleAtoi(p->default_text, &def)) {
    Fail(absl::StrCat("the default of ", key, " is not an integer"));
  }
  return Int(key, def, static_cast<int64_t>(p->min),
             static_cast<int64_t>(p->max));
}

double ParamReader::Double(absl::string_view key) {
  const ParamSpec* p = Known(key, ParamType::kDouble);
  double def = 0;
  if (p == nullptr) return def;
  if (!absl::SimpleAtod(p->default_text, &def)) {
    Fail(absl::StrCat("the default of ", key, " is not a number"));
  }
  return Double(key, def, p->min, p->max);
}

std::string ParamReader::Choice(absl::string_view key) {
  const ParamSpec* p = Known(key, ParamType::kChoice);
  if (p == nullptr) return "";
  const std::string* text = Find(key);
  if (text == nullptr) return std::string(p->default_text);
  for (absl::string_view c : p->choices) {
    if (*text == c) return *text;
  }
  Fail(absl::StrCat(key, " = ", Quote(*text), " is not one of ",
                    absl::StrJoin(p->choices, ", ")));
  return std::string(p->default_text);
}

CommonParams ParamReader::Common() {
  CommonParams c;
  for (const ParamSpec& p : known_) {
    if (p.name == "sinks") c.sinks = Int("sinks");
    if (p.name == "recent") c.recent = Int("recent");
    if (p.name == "slack") c.slack = Int("slack");
  }
  c.sinks = std::max(c.sinks, spec_.protect_first);
  return c;
}

absl::Status ParamReader::Finish() const {
  if (!error_.ok()) return error_;
  for (const auto& [key, value] : spec_.params) {
    if (!used_.contains(key)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "policy '", spec_.name, "' has no parameter ", Quote(key), "; ",
          used_.empty()
              ? std::string("it takes none")
              : absl::StrCat("it takes: ", absl::StrJoin(used_, ", "))));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvkeep
