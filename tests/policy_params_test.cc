// Tests of policy construction from text parameters (policy_registry.h,
// policy_params.h) and of EvictionPolicy::ValidateBudget: every failure is
// INVALID_ARGUMENT with a message that says what to fix.
#include "cache_store/policy_params.h"

#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cache_store/eviction_policy.h"
#include "cache_store/policy_registry.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvkeep {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::UnorderedElementsAre;

absl::StatusOr<PolicyPtr> Make(std::string name,
                               std::map<std::string, std::string> params = {}) {
  return NewPolicy(PolicySpec{std::move(name), std::move(params)});
}

PolicyPtr MakeOk(std::string name,
                 std::map<std::string, std::string> params = {}) {
  absl::StatusOr<PolicyPtr> p = Make(name, params);
  EXPECT_TRUE(p.ok()) << name << ": " << p.status();
  return p.ok() ? *p : nullptr;
}

TEST(PolicyRegistryTest, NamesAreTheDocumentedOnes) {
  EXPECT_THAT(PolicyNames(), UnorderedElementsAre(
                                 "full", "window", "streaming_llm", "h2o",
                                 "tova", "scissorhands", "snapkv", "h2o_page"));
}

TEST(PolicyRegistryTest, EveryPolicyBuildsWithDefaults) {
  for (absl::string_view name : PolicyNames()) {
    SCOPED_TRACE(name);
    PolicyPtr p = MakeOk(std::string(name));
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(p->name(), name);
    // With defaults, a generous budget is always acceptable.
    EXPECT_TRUE(p->ValidateBudget(4096, 16).ok());
  }
}

TEST(PolicyRegistryTest, TriggersAndDefaults) {
  struct Want {
    const char* name;
    EvictionTrigger trigger;
    int64_t sinks, recent, slack;
    bool history;
  };
  const Want wants[] = {
      {"full", EvictionTrigger::kNever, 0, 0, 0, false},
      {"window", EvictionTrigger::kOnAppend, 0, 0, 0, false},
      {"streaming_llm", EvictionTrigger::kOnAppend, 4, 0, 0, false},
      {"h2o", EvictionTrigger::kOnAttention, 0, 0, 0, false},
      {"tova", EvictionTrigger::kOnAttention, 0, 0, 0, false},
      {"scissorhands", EvictionTrigger::kOnAttention, 0, 0, 0, true},
      {"snapkv", EvictionTrigger::kOnCompress, 0, 32, 0, false},
      {"h2o_page", EvictionTrigger::kOnAttention, 0, 0, 0, false},
  };
  for (const Want& w : wants) {
    SCOPED_TRACE(w.name);
    PolicyPtr p = MakeOk(w.name);
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(p->trigger(), w.trigger);
    EXPECT_EQ(p->common().sinks, w.sinks);
    EXPECT_EQ(p->common().recent, w.recent);
    EXPECT_EQ(p->common().slack, w.slack);
    EXPECT_EQ(p->protected_tokens(), w.sinks + w.recent);
    EXPECT_EQ(p->uses_history(), w.history);
  }
}

TEST(PolicyRegistryTest, ParametersAreRead) {
  PolicyPtr h2o =
      MakeOk("h2o", {{"sinks", "2"}, {"recent", "30"}, {"slack", "5"}});
  ASSERT_NE(h2o, nullptr);
  EXPECT_EQ(h2o->common().sinks, 2);
  EXPECT_EQ(h2o->common().recent, 30);
  EXPECT_EQ(h2o->common().slack, 5);
  EXPECT_EQ(h2o->protected_tokens(), 32);

  PolicyPtr window = MakeOk("window", {{"slack", "3"}});
  ASSERT_NE(window, nullptr);
  EXPECT_EQ(window->common().slack, 3);

  PolicyPtr snap = MakeOk(
      "snapkv", {{"window", "8"}, {"kernel", "1"}, {"pooling", "maxpool"}});
  ASSERT_NE(snap, nullptr);
  EXPECT_EQ(snap->protected_tokens(), 8);  // the window is kept whole

  // Range ends are accepted.
  EXPECT_NE(MakeOk("scissorhands", {{"history", "64"}, {"threshold", "0"}}),
            nullptr);
  EXPECT_NE(MakeOk("scissorhands", {{"history", "1"}, {"threshold", "2.5"}}),
            nullptr);
  EXPECT_NE(MakeOk("snapkv", {{"kernel", "1025"}}), nullptr);
  EXPECT_NE(MakeOk("h2o", {{"recent", "1099511627776"}}), nullptr);  // 2^40
}

void ExpectInvalid(const absl::StatusOr<PolicyPtr>& p,
                   std::vector<std::string> substrings) {
  ASSERT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument)
      << p.status();
  for (const std::string& s : substrings) {
    EXPECT_THAT(p.status().message(), HasSubstr(s));
  }
}

TEST(PolicyRegistryTest, UnknownPolicyListsTheKnownOnes) {
  ExpectInvalid(Make("h20"), {"h20", "h2o", "streaming_llm", "snapkv"});
  ExpectInvalid(Make(""), {"unknown policy"});
  ExpectInvalid(Make("H2O"), {"H2O"});  // names are case-sensitive
}

TEST(PolicyRegistryTest, UnknownParameterListsAcceptedOnes) {
  ExpectInvalid(Make("h2o", {{"recnet", "4"}}),
                {"h2o", "recnet", "sinks", "recent", "slack"});
  ExpectInvalid(Make("snapkv", {{"window_size", "4"}}),
                {"window_size", "window", "kernel", "pooling"});
  ExpectInvalid(Make("scissorhands", {{"hist", "4"}}),
                {"hist", "history", "threshold", "sinks", "recent", "slack"});
  // window has no sinks: it is streaming_llm without them.
  ExpectInvalid(Make("window", {{"sinks", "4"}}), {"sinks", "slack"});
  ExpectInvalid(Make("full", {{"recent", "4"}}), {"full", "recent"});
  // snapkv keeps its window whole; it takes no sinks/recent/slack.
  ExpectInvalid(Make("snapkv", {{"recent", "4"}}), {"recent"});
}

TEST(PolicyRegistryTest, NonIntegerValues) {
  for (const char* text :
       {"abc", "1.5", "", "4x", "0x10", "99999999999999999999999"}) {
    SCOPED_TRACE(text);
    ExpectInvalid(Make("h2o", {{"recent", text}}),
                  {"recent", "not an integer"});
  }
  ExpectInvalid(Make("scissorhands", {{"threshold", "high"}}), {"threshold"});
}

TEST(PolicyRegistryTest, OutOfRangeValues) {
  ExpectInvalid(Make("h2o", {{"recent", "-1"}}), {"recent", "-1", "outside"});
  ExpectInvalid(Make("h2o", {{"sinks", "1099511627777"}}),  // 2^40 + 1
                {"sinks", "outside"});
  ExpectInvalid(Make("streaming_llm", {{"slack", "-3"}}), {"slack"});
  ExpectInvalid(Make("scissorhands", {{"history", "0"}}), {"history"});
  ExpectInvalid(Make("scissorhands", {{"history", "65"}}), {"history", "65"});
  ExpectInvalid(Make("scissorhands", {{"threshold", "-0.5"}}), {"threshold"});
  ExpectInvalid(Make("scissorhands", {{"threshold", "nan"}}), {"threshold"});
  ExpectInvalid(Make("scissorhands", {{"threshold", "inf"}}), {"threshold"});
  ExpectInvalid(Make("snapkv", {{"window", "0"}}), {"window"});
  ExpectInvalid(Make("snapkv", {{"kernel", "0"}}), {"kernel"});
  ExpectInvalid(Make("snapkv", {{"kernel", "1027"}}), {"kernel"});
}

TEST(PolicyRegistryTest, SnapKvKernelMustBeOddAndPoolingKnown) {
  for (const char* k : {"2", "4", "1024"}) {
    ExpectInvalid(Make("snapkv", {{"kernel", k}}), {"kernel", k, "odd"});
  }
  ExpectInvalid(Make("snapkv", {{"pooling", "sumpool"}}),
                {"pooling", "sumpool", "avgpool", "maxpool"});
  ExpectInvalid(Make("snapkv", {{"pooling", "avg"}}), {"avgpool"});
}

TEST(PolicyRegistryTest, MessageNamesThePolicy) {
  const absl::StatusOr<PolicyPtr> p = Make("tova", {{"recent", "x"}});
  ASSERT_FALSE(p.ok());
  EXPECT_THAT(p.status().message(), AllOf(HasSubstr("tova"), HasSubstr("'x'")));
}

TEST(ParamReaderTest, TypedGettersAndFinish) {
  const PolicySpec spec{"test",
                        {{"i", "42"}, {"d", "0.25"}, {"c", "b"}, {"t", "7"}}};
  ParamReader r(spec);
  EXPECT_EQ(r.Int("i", 0, 0, 100), 42);
  EXPECT_EQ(r.Double("d", 1.0, 0.0, 1.0), 0.25);
  EXPECT_EQ(r.Choice("c", "a", {"a", "b"}), "b");
  EXPECT_EQ(r.Tokens("t", 3), 7);
  EXPECT_EQ(r.Int("missing", 9, 0, 10), 9);  // defaults are not range-checked
  EXPECT_TRUE(r.Finish().ok());
}

TEST(ParamReaderTest, FirstErrorWinsAndGettersReturnDefaults) {
  const PolicySpec spec{"test", {{"a", "x"}, {"b", "500"}}};
  ParamReader r(spec);
  EXPECT_EQ(r.Int("a", 5, 0, 10), 5);
  EXPECT_EQ(r.Int("b", 6, 0, 10), 6);
  const absl::Status s = r.Finish();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("a = 'x'"));
  EXPECT_THAT(s.message(), HasSubstr("test"));
}

TEST(ParamReaderTest, FailIsReported) {
  const PolicySpec spec{"test", {}};
  ParamReader r(spec);
  r.Fail("window must exceed kernel");
  EXPECT_EQ(r.Finish().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.Finish().message(), HasSubstr("window must exceed kernel"));
}

TEST(ValidateBudgetTest, BudgetMustHoldProtectedTokens) {
  PolicyPtr p = MakeOk("h2o", {{"sinks", "4"}, {"recent", "8"}});
  ASSERT_NE(p, nullptr);
  EXPECT_TRUE(p->ValidateBudget(12, 16).ok());
  EXPECT_TRUE(p->ValidateBudget(13, 1).ok());
  const absl::Status s = p->ValidateBudget(11, 16);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("h2o"), HasSubstr("11"),
                                 HasSubstr("sinks 4"), HasSubstr("recent 8")));
  EXPECT_EQ(p->ValidateBudget(0, 16).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(p->ValidateBudget(-5, 16).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ValidateBudgetTest, SlackComesOutOfTheBudget) {
  PolicyPtr p =
      MakeOk("tova", {{"sinks", "2"}, {"recent", "6"}, {"slack", "3"}});
  ASSERT_NE(p, nullptr);
  EXPECT_TRUE(p->ValidateBudget(11, 16).ok());  // 11 - 3 = 8 = 2 + 6
  const absl::Status s = p->ValidateBudget(10, 16);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("slack 3"));
  // Without protected tokens, the slack alone must still fit.
  PolicyPtr w = MakeOk("window", {{"slack", "5"}});
  ASSERT_NE(w, nullptr);
  EXPECT_TRUE(w->ValidateBudget(6, 16).ok());
  EXPECT_EQ(w->ValidateBudget(4, 16).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ValidateBudgetTest, PerPolicyRules) {
  // streaming_llm's 4 default sinks.
  PolicyPtr s = MakeOk("streaming_llm");
  ASSERT_NE(s, nullptr);
  EXPECT_TRUE(s->ValidateBudget(4, 16).ok());
  EXPECT_EQ(s->ValidateBudget(3, 16).code(),
            absl::StatusCode::kInvalidArgument);
  // snapkv's window is protected.
  PolicyPtr snap = MakeOk("snapkv", {{"window", "16"}});
  ASSERT_NE(snap, nullptr);
  EXPECT_TRUE(snap->ValidateBudget(16, 16).ok());
  EXPECT_EQ(snap->ValidateBudget(15, 16).code(),
            absl::StatusCode::kInvalidArgument);
  // full ignores the budget.
  PolicyPtr full = MakeOk("full");
  ASSERT_NE(full, nullptr);
  EXPECT_TRUE(full->ValidateBudget(0, 16).ok());
  // Page-level h2o: the same token rule.
  PolicyPtr page = MakeOk("h2o_page", {{"sinks", "1"}, {"recent", "3"}});
  ASSERT_NE(page, nullptr);
  EXPECT_TRUE(page->ValidateBudget(4, 16).ok());
  EXPECT_EQ(page->ValidateBudget(3, 16).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ValidateBudgetTest, SlackMustLeaveAToken) {
  // Nothing protected, but a layer must never be cut to zero tokens.
  PolicyPtr p = MakeOk("window", {{"slack", "8"}});
  absl::Status s = p->ValidateBudget(8, 16);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("at least one token"));
  EXPECT_TRUE(p->ValidateBudget(9, 16).ok());
}

TEST(PolicyRegistryTest, FullTakesNoParameters) {
  absl::StatusOr<PolicyPtr> p = Make("full", {{"recent", "4"}});
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(p.status().message(), HasSubstr("it takes none"));
}

// The registry's table (what ServerInfo publishes) agrees with the policies
// it builds: every parameter listed is read, with its default and range.
TEST(PolicyTableTest, ListsEveryPolicyOnceInNameOrder) {
  std::vector<absl::string_view> names;
  for (const PolicyInfo& p : Policies()) {
    names.push_back(p.name);
    EXPECT_EQ(FindPolicy(p.name), &p);
    EXPECT_FALSE(p.summary.empty()) << p.name;
    EXPECT_FALSE(p.budget_rule.empty()) << p.name;
  }
  EXPECT_EQ(names, PolicyNames());
  EXPECT_EQ(FindPolicy("h20"), nullptr);
}

TEST(PolicyTableTest, InputMatchesTheTrigger) {
  for (const PolicyInfo& info : Policies()) {
    SCOPED_TRACE(info.name);
    PolicyPtr p = MakeOk(std::string(info.name));
    ASSERT_NE(p, nullptr);
    switch (p->trigger()) {
      case EvictionTrigger::kNever:
      case EvictionTrigger::kOnAppend:
        EXPECT_EQ(info.input, PolicyInput::kNone);
        break;
      case EvictionTrigger::kOnAttention:
        EXPECT_EQ(info.input, PolicyInput::kPerStep);
        break;
      case EvictionTrigger::kOnCompress:
        EXPECT_EQ(info.input, PolicyInput::kCompress);
        break;
    }
  }
}

TEST(PolicyTableTest, DefaultsAreWhatThePolicyUses) {
  for (const PolicyInfo& info : Policies()) {
    std::map<std::string, std::string> defaults;
    for (const ParamSpec& param : info.params) {
      defaults[std::string(param.name)] = std::string(param.default_text);
    }
    SCOPED_TRACE(info.name);
    PolicyPtr implicit = MakeOk(std::string(info.name));
    PolicyPtr explicit_ = MakeOk(std::string(info.name), defaults);
    ASSERT_NE(implicit, nullptr);
    ASSERT_NE(explicit_, nullptr);
    EXPECT_EQ(implicit->common().sinks, explicit_->common().sinks);
    EXPECT_EQ(implicit->common().recent, explicit_->common().recent);
    EXPECT_EQ(implicit->common().slack, explicit_->common().slack);
  }
}

TEST(PolicyTableTest, RangesAreTheOnesEnforced) {
  for (const PolicyInfo& info : Policies()) {
    for (const ParamSpec& param : info.params) {
      const std::string name(param.name);
      SCOPED_TRACE(absl::StrCat(info.name, ".", name));
      auto make = [&](const std::string& value) {
        return Make(std::string(info.name), {{name, value}});
      };
      switch (param.type) {
        case ParamType::kInt: {
          const auto lo = static_cast<int64_t>(param.min);
          const auto hi = static_cast<int64_t>(param.max);
          EXPECT_TRUE(make(absl::StrCat(lo)).ok());
          EXPECT_TRUE(make(absl::StrCat(hi)).ok());
          EXPECT_EQ(make(absl::StrCat(lo - 1)).status().code(),
                    absl::StatusCode::kInvalidArgument);
          EXPECT_EQ(make(absl::StrCat(hi + 1)).status().code(),
                    absl::StatusCode::kInvalidArgument);
          break;
        }
        case ParamType::kDouble:
          EXPECT_TRUE(make(absl::StrCat(param.min)).ok());
          EXPECT_TRUE(make(absl::StrCat(param.max)).ok());
          EXPECT_FALSE(make(absl::StrCat(param.min - 1)).ok());
          EXPECT_FALSE(make(absl::StrCat(param.max * 2)).ok());
          break;
        case ParamType::kChoice:
          EXPECT_FALSE(param.choices.empty());
          for (absl::string_view c : param.choices) {
            EXPECT_TRUE(make(std::string(c)).ok()) << c;
          }
          EXPECT_FALSE(make("no such choice").ok());
          break;
      }
    }
  }
}

TEST(ParamReaderTest, ReadsByTheTable) {
  constexpr absl::string_view kChoices[] = {"a", "b"};
  const ParamSpec known[] = {
      {"i", ParamType::kInt, "7", 0, 10, {}, "", ""},
      {"d", ParamType::kDouble, "0.5", 0, 1, {}, "", ""},
      {"c", ParamType::kChoice, "a", 0, 0, kChoices, "", ""},
  };
  const PolicySpec given{"test", {{"i", "3"}}};
  ParamReader r(given, known);
  EXPECT_EQ(r.Int("i"), 3);
  EXPECT_EQ(r.Double("d"), 0.5);
  EXPECT_EQ(r.Choice("c"), "a");
  EXPECT_TRUE(r.Finish().ok());

  const PolicySpec bad{"test", {{"i", "11"}}};
  ParamReader out_of_range(bad, known);
  EXPECT_EQ(out_of_range.Int("i"), 7);
  EXPECT_THAT(out_of_range.Finish().message(),
              HasSubstr("i = 11 is outside [0, 10]"));

  // A key the table does not list is a bug of the factory, not the client's.
  const PolicySpec none{"test", {}};
  ParamReader unlisted(none, known);
  unlisted.Int("missing");
  EXPECT_EQ(unlisted.Finish().code(), absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace kvkeep
