// Tests of the byte-level BPE tokenizer. The first part builds tokenizers
// from small hand-made vocabularies and needs nothing else; the second loads
// SmolLM2's GGUF ($KVKEEP_MODEL) and holds its ids to the Hugging Face
// reference (tokenizer_reference.json in $KVKEEP_LM_TESTDATA, else in the
// data/ folder beside this file), skipping when the model file is absent.
#include "services/lm/tokenizer.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <initializer_list>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "services/lm/gguf.h"

namespace kvkeep::lm {
namespace {

std::vector<int32_t> Ids(std::initializer_list<int32_t> ids) { return ids; }
std::vector<std::string> Strs(std::initializer_list<std::string> s) {
  return s;
}
bool Contains(absl::string_view text, std::string_view part) {
  return std::string_view(text.data(), text.size()).find(part) !=
         std::string_view::npos;
}

// GPT-2's bytes_to_unicode, written again here as the test's own reference:
// the printable bytes stand for themselves, the n-th other byte for U+0100+n.
std::string Spell(std::string_view bytes) {
  std::string out;
  for (const char ch : bytes) {
    const int b = static_cast<uint8_t>(ch);
    int cp = b;
    if (!((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE)) {
      int n = 0;
      for (int o = 0; o < b; ++o) {
        if (!((o >= '!' && o <= '~') || (o >= 0xA1 && o <= 0xAC) ||
              o >= 0xAE)) {
          ++n;
        }
      }
      cp = 256 + n;
    }
    if (cp < 0x80) {
      out.push_back(static_cast<char>(cp));
    } else {
      out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }
  return out;
}

// A vocabulary whose token b (0..255) is byte b, plus merges and specials
// added in order.
class TinyVocab {
 public:
  explicit TinyVocab(PreTokenizer pre = PreTokenizer::kSmolLm) {
    vocab_.pre_tokenizer = pre;
    for (int b = 0; b < 256; ++b) {
      vocab_.tokens.push_back(Spell(std::string(1, static_cast<char>(b))));
      vocab_.token_types.push_back(1);
    }
  }

  // Adds the merge of the tokens for raw bytes `left` and `right` (adding
  // their concatenation as a token when new) at the next rank; returns the
  // merged token's id.
  int32_t Merge(std::string_view left, std::string_view right) {
    vocab_.merges.push_back(Spell(left) + " " + Spell(right));
    const std::string merged = Spell(std::string(left) + std::string(right));
    for (size_t i = 0; i < vocab_.tokens.size(); ++i) {
      if (vocab_.tokens[i] == merged) return static_cast<int32_t>(i);
    }
    return Add(merged, TokenType::kNormal);
  }

  int32_t Add(std::string text, TokenType type) {
    vocab_.tokens.push_back(std::move(text));
    vocab_.token_types.push_back(static_cast<int32_t>(type));
    return static_cast<int32_t>(vocab_.tokens.size() - 1);
  }

  TokenizerVocab& vocab() { return vocab_; }

  std::unique_ptr<Tokenizer> Build() const {
    absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::Create(vocab_);
    EXPECT_TRUE(tok.ok()) << tok.status();
    return tok.ok() ? *std::move(tok) : nullptr;
  }

 private:
  TokenizerVocab vocab_;
};

// The ids of the bytes of `text` in a TinyVocab.
std::vector<int32_t> Bytes(std::string_view text) {
  std::vector<int32_t> ids;
  for (const char ch : text) ids.push_back(static_cast<uint8_t>(ch));
  return ids;
}

std::vector<std::string> Pieces(std::string_view text, PreTokenizer pre) {
  std::vector<std::string> out;
  for (const std::string_view piece : PreTokenize(text, pre)) {
    out.emplace_back(piece);
  }
  return out;
}

void ExpectRoundTrip(const Tokenizer& tok, std::string_view text,
                     bool parse_special) {
  absl::StatusOr<std::string> back =
      tok.Decode(tok.Encode(text, parse_special));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, text);
}

// ---------------------------------------------------------------------------
// Pre-tokenization. Expected pieces are Hugging Face's pre_tokenize_str of
// Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)]
// (kSmolLm) and of ByteLevel alone (kGpt2), tokenizers 0.23.3.

struct PieceCase {
  std::string text;
  std::vector<std::string> smollm;
  std::vector<std::string> gpt2;
};

TEST(PreTokenizeTest, CutsLikeTheReference) {
  const std::vector<PieceCase> cases = {
      {"a   b", {"a", "  ", " b"}, {"a", "  ", " b"}},
      {"Hello world", {"Hello", " world"}, {"Hello", " world"}},
      {"it's we'll they're I'M 'sup",
       {"it", "'s", " we", "'ll", " they", "'re", " I", "'", "M", " '", "sup"},
       {"it", "'s", " we", "'ll", " they", "'re", " I", "'", "M", " '", "sup"}},
      {"'ll've", {"'ll", "'ve"}, {"'ll", "'ve"}},
      {"'", {"'"}, {"'"}},
      {"abc123 x1.5",
       {"abc", "1", "2", "3", " x", "1", ".", "5"},
       {"abc", "123", " x", "1", ".", "5"}},
      {"a  1", {"a", "  ", "1"}, {"a", " ", " 1"}},
      {"\n\nx", {"\n", "\n", "x"}, {"\n", "\n", "x"}},
      {"a  ", {"a", "  "}, {"a", "  "}},
      {"  a", {" ", " a"}, {" ", " a"}},
      {"  \n  x", {"  \n ", " x"}, {"  \n ", " x"}},
      {" !!?x", {" !!?", "x"}, {" !!?", "x"}},
      {"tab\t\tend\t",
       {"tab", "\t", "\t", "end", "\t"},
       {"tab", "\t", "\t", "end", "\t"}},
      {"h\xC3\xA9llo w\xC3\xB6rld",  // héllo wörld
       {"h\xC3\xA9llo", " w\xC3\xB6rld"},
       {"h\xC3\xA9llo", " w\xC3\xB6rld"}},
      {"e\xCC\x81",  // e + combining acute: a mark is neither L nor
                     // N
       {"e", "\xCC\x81"},
       {"e", "\xCC\x81"}},
      {"a\xC2\xA0"
       "b",  // no-break space: \s, but not the optional ' '
       {"a", "\xC2\xA0", "b"},
       {"a", "\xC2\xA0", "b"}},
      {"a\xE3\x80\x80\xE3\x80\x80"
       "b",  // two ideographic spaces
       {"a", "\xE3\x80\x80", "\xE3\x80\x80", "b"},
       {"a", "\xE3\x80\x80", "\xE3\x80\x80", "b"}},
      {"x\xC2\xB2\xC2\xB3 \xC2\xBD",  // x²³ ½: \p{N} beyond the
                                      // digits
       {"x", "\xC2\xB2", "\xC2\xB3", " ", "\xC2\xBD"},
       {"x", "\xC2\xB2\xC2\xB3", " \xC2\xBD"}},
      {"\xE6\x9D\xB1\xE4\xBA\xAC\xE3\x82\xBF\xE3\x83\xAF\xE3\x83"
       "\xBC",  // 東京タワー
       {"\xE6\x9D\xB1\xE4\xBA\xAC\xE3\x82\xBF\xE3\x83\xAF\xE3\x83"
        "\xBC"},
       {"\xE6\x9D\xB1\xE4\xBA\xAC\xE3\x82\xBF\xE3\x83\xAF\xE3\x83"
        "\xBC"}},
      {"", {}, {}},
  };
  for (const PieceCase& c : cases) {
    EXPECT_EQ(Pieces(c.text, PreTokenizer::kSmolLm), c.smollm) << c.text;
    EXPECT_EQ(Pieces(c.text, PreTokenizer::kGpt2), c.gpt2) << c.text;
  }
}

TEST(PreTokenizeTest, InvalidBytesAreCodePointsOfNoClass) {
  // A lone continuation byte, a truncated sequence, a surrogate, an
  // overlong form and a byte past F4 each count as punctuation-like code
  // points, one per byte.
  EXPECT_EQ(Pieces("a\xFF"
                   "b",
                   PreTokenizer::kSmolLm),
            Strs({"a", "\xFF", "b"}));
  EXPECT_EQ(Pieces("ab \x80\x80!", PreTokenizer::kSmolLm),
            Strs({"ab", " \x80\x80!"}));
  EXPECT_EQ(Pieces("x\xE6\x9D", PreTokenizer::kSmolLm),
            Strs({"x", "\xE6\x9D"}));
  EXPECT_EQ(Pieces("x\xED\xA0\x80y", PreTokenizer::kSmolLm),
            Strs({"x", "\xED\xA0\x80", "y"}));
  EXPECT_EQ(Pieces("\xC0\xAF \xF5", PreTokenizer::kSmolLm),
            Strs({"\xC0\xAF", " \xF5"}));
}

TEST(PreTokenizeTest, PiecesAreNonEmptyAndCoverTheText) {
  std::mt19937 rng(7);
  // Bytes drawn mostly from ASCII with some UTF-8 lead and continuation
  // bytes, so that valid and invalid sequences both occur.
  const std::string alphabet =
      "ab 1\t\n'sre!\xC3\xA9\xE3\x80\x80\xC2\xB2\xFF\x80";
  for (int round = 0; round < 2000; ++round) {
    std::string text;
    const int n = static_cast<int>(rng() % 24);
    for (int i = 0; i < n; ++i) text += alphabet[rng() % alphabet.size()];
    for (const PreTokenizer pre :
         {PreTokenizer::kSmolLm, PreTokenizer::kGpt2}) {
      std::string joined;
      for (const std::string_view piece : PreTokenize(text, pre)) {
        ASSERT_FALSE(piece.empty()) << text;
        joined += piece;
      }
      ASSERT_EQ(joined, text);
    }
  }
}

// ---------------------------------------------------------------------------
// BPE on a tiny vocabulary.

TEST(TokenizerTest, MergesByRank) {
  TinyVocab low_bc;
  const int32_t bc = low_bc.Merge("b", "c");
  low_bc.Merge("a", "b");
  EXPECT_EQ(low_bc.Build()->Encode("abc", false), Ids({'a', bc}));

  TinyVocab low_ab;
  const int32_t ab = low_ab.Merge("a", "b");
  low_ab.Merge("b", "c");
  EXPECT_EQ(low_ab.Build()->Encode("abc", false), Ids({ab, 'c'}));
}

TEST(TokenizerTest, MergesChainAndPreferTheLeftmostOfEqualRanks) {
  TinyVocab v;
  const int32_t aa = v.Merge("a", "a");
  const int32_t aaaa = v.Merge("aa", "aa");
  const int32_t ab = v.Merge("a", "b");
  const int32_t abc = v.Merge("ab", "c");
  std::unique_ptr<Tokenizer> tok = v.Build();
  EXPECT_EQ(tok->Encode("aaa", false), Ids({aa, 'a'}));
  EXPECT_EQ(tok->Encode("aaaa", false), Ids({aaaa}));
  EXPECT_EQ(tok->Encode("aaaaa", false), Ids({aaaa, 'a'}));
  EXPECT_EQ(tok->Encode("abc", false), Ids({abc}));
  EXPECT_EQ(tok->Encode("aabc", false), Ids({aa, 'b', 'c'}));
  EXPECT_EQ(tok->Encode("ab", false), Ids({ab}));
}

TEST(TokenizerTest, FallsBackToByteTokens) {
  TinyVocab v;
  v.Merge("a", "b");
  std::unique_ptr<Tokenizer> tok = v.Build();
  // é and 東 have no merges: their UTF-8 bytes' tokens.
  EXPECT_EQ(tok->Encode("\xC3\xA9\xE6\x9D\xB1", false),
            Bytes("\xC3\xA9\xE6\x9D\xB1"));
  EXPECT_EQ(tok->token(0xC3), "\xC3\x83");  // 'Ã'
  EXPECT_EQ(tok->token(' '), "\xC4\xA0");   // 'Ġ'
  ExpectRoundTrip(*tok, "\xC3\xA9\xE6\x9D\xB1", false);
}

TEST(TokenizerTest, DropsBytesWithoutATokenBeforeMerging) {
  TinyVocab v;
  const int32_t bang2 = v.Merge("!", "!");
  v.vocab().tokens[0x04] = "not a byte";  // byte 04 has no token now
  v.vocab().tokens[0xFF] = "nor this";
  std::unique_ptr<Tokenizer> tok = v.Build();
  // As Hugging Face's BPE without an unknown token: the byte goes, and its
  // neighbours in the piece may then merge.
  EXPECT_EQ(tok->Encode("a\x04"
                        "b",
                        false),
            Ids({'a', 'b'}));
  EXPECT_EQ(tok->Encode("!\x04!", false), Ids({bang2}));
  EXPECT_EQ(tok->Encode("\x04", false), Ids({}));
  EXPECT_EQ(tok->Encode("\xFF\xFF x", false), Ids({' ', 'x'}));
}

TEST(TokenizerTest, SpaceIsSpelledAsTheByteAlphabetSpellsIt) {
  TinyVocab v;
  const int32_t space_a = v.Merge(" ", "a");
  std::unique_ptr<Tokenizer> tok = v.Build();
  EXPECT_EQ(tok->token(space_a),
            "\xC4\xA0"
            "a");  // "Ġa"
  EXPECT_EQ(tok->Encode("a a", false), Ids({'a', space_a}));
  absl::StatusOr<std::string> text = tok->Decode({space_a});
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text, " a");
}

TEST(TokenizerTest, SmolLmSplitsDigitsAndGpt2DoesNot) {
  TinyVocab smollm(PreTokenizer::kSmolLm);
  smollm.Merge("1", "2");
  TinyVocab gpt2(PreTokenizer::kGpt2);
  const int32_t twelve = gpt2.Merge("1", "2");
  EXPECT_EQ(smollm.Build()->Encode("12", false), Ids({'1', '2'}));
  EXPECT_EQ(gpt2.Build()->Encode("12", false), Ids({twelve}));
}

TEST(TokenizerTest, WhitespaceRunsLeaveTheirLastSpaceToTheNextWord) {
  for (const PreTokenizer pre : {PreTokenizer::kSmolLm, PreTokenizer::kGpt2}) {
    TinyVocab v(pre);
    const int32_t two = v.Merge(" ", " ");
    const int32_t space_b = v.Merge(" ", "b");
    const int32_t space_1 = v.Merge(" ", "1");
    std::unique_ptr<Tokenizer> tok = v.Build();
    EXPECT_EQ(tok->Encode("a   b", false), Ids({'a', two, space_b}));
    EXPECT_EQ(tok->Encode("a  ", false), Ids({'a', two}));
    EXPECT_EQ(tok->Encode("a\n\n b", false), Ids({'a', '\n', '\n', space_b}));
    if (pre == PreTokenizer::kSmolLm) {
      // The digit is its own piece, so the run before it ends the text the
      // regex sees and stays whole.
      EXPECT_EQ(tok->Encode("a  1", false), Ids({'a', two, '1'}));
    } else {
      EXPECT_EQ(tok->Encode("a  1", false), Ids({'a', ' ', space_1}));
    }
  }
}

TEST(TokenizerTest, ContractionsAreTheirOwnPieces) {
  TinyVocab v;
  const int32_t apostrophe_t = v.Merge("'", "t");
  v.Merge("n", "'");  // never applies: ' starts a piece
  std::unique_ptr<Tokenizer> tok = v.Build();
  EXPECT_EQ(tok->Encode("don't", false), Ids({'d', 'o', 'n', apostrophe_t}));
  // Case-sensitive: 'T is no contraction.
  EXPECT_EQ(tok->Encode("DON'T", false), Ids({'D', 'O', 'N', '\'', 'T'}));
}

TEST(TokenizerTest, ParsesSpecialTokensOnlyWhenAsked) {
  TinyVocab v;
  const int32_t start = v.Add("<|im_start|>", TokenType::kControl);
  const int32_t end = v.Add("<|im_end|>", TokenType::kControl);
  const int32_t think = v.Add("<think>", TokenType::kUserDefined);
  std::unique_ptr<Tokenizer> tok = v.Build();
  const std::string text = "<|im_start|>user\nhi<|im_end|>";
  std::vector<int32_t> want = {start};
  for (const int32_t id : Bytes("user\nhi")) want.push_back(id);
  want.push_back(end);
  EXPECT_EQ(tok->Encode(text, true), want);
  EXPECT_EQ(tok->Encode(text, false), Bytes(text));
  // User-defined tokens are matched either way.
  EXPECT_EQ(tok->Encode("<think>x", false), Ids({think, 'x'}));
  EXPECT_EQ(tok->Encode("<think>x", true), Ids({think, 'x'}));
  ExpectRoundTrip(*tok, text, true);
  ExpectRoundTrip(*tok, text, false);
}

TEST(TokenizerTest, SpecialTokensMatchLeftmostThenLongestAndCutPieces) {
  TinyVocab v;
  const int32_t a = v.Add("<a>", TokenType::kControl);
  const int32_t ab = v.Add("<a>b", TokenType::kControl);
  const int32_t space_b = v.Merge(" ", "b");
  const int32_t two = v.Merge(" ", " ");
  std::unique_ptr<Tokenizer> tok = v.Build();
  EXPECT_EQ(tok->Encode("<a>b<a>", true), Ids({ab, a}));
  EXPECT_EQ(tok->Encode("<<a>", true), Ids({'<', a}));
  EXPECT_EQ(tok->Encode("<a><a>", true), Ids({a, a}));
  // Text on each side of a special token is pre-tokenized alone: "  b"
  // after it is " " and " b", and the spaces before it end their text.
  EXPECT_EQ(tok->Encode("x  <a>  b", true), Ids({'x', two, a, ' ', space_b}));
}

TEST(TokenizerTest, DecodeRefusesIdsOutsideTheVocabulary) {
  std::unique_ptr<Tokenizer> tok = TinyVocab().Build();
  absl::StatusOr<std::string> text = tok->Decode({'a', 256});
  EXPECT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_PRED2(Contains, text.status().message(), "id 256 at position 1");
  EXPECT_EQ(tok->Decode({-1}).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::string> empty = tok->Decode({});
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(*empty, "");
}

TEST(TokenizerTest, Accessors) {
  TinyVocab v;
  const int32_t end = v.Add("<|endoftext|>", TokenType::kControl);
  const int32_t im_end = v.Add("<|im_end|>", TokenType::kControl);
  v.Add("<|im_start|>", TokenType::kControl);
  v.vocab().bos_id = 'B';
  v.vocab().eos_id = im_end;
  std::unique_ptr<Tokenizer> tok = v.Build();
  EXPECT_EQ(tok->vocab_size(), 259);
  EXPECT_EQ(tok->bos_id(), 'B');
  EXPECT_EQ(tok->eos_id(), im_end);
  EXPECT_EQ(tok->StopIds(), Ids({end, im_end}));
  EXPECT_EQ(tok->token(end), "<|endoftext|>");
  EXPECT_EQ(tok->token(-1), "");
  EXPECT_EQ(tok->token(259), "");
  EXPECT_EQ(tok->token_type(end), TokenType::kControl);
  EXPECT_EQ(tok->token_type('a'), TokenType::kNormal);
  EXPECT_EQ(tok->token_type(259), TokenType::kUndefined);
  EXPECT_EQ(tok->pre_tokenizer(), PreTokenizer::kSmolLm);
  EXPECT_EQ(TinyVocab().Build()->bos_id(), -1);
}

TEST(TokenizerTest, CreateRefusesBrokenVocabularies) {
  const auto refused = [](TinyVocab v, std::string_view what) {
    absl::StatusOr<std::unique_ptr<Tokenizer>> tok =
        Tokenizer::Create(v.vocab());
    EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_PRED2(Contains, tok.status().message(), std::string(what));
  };
  TinyVocab none;
  none.vocab().tokens.clear();
  none.vocab().token_types.clear();
  refused(none, "no tokens");

  TinyVocab short_types;
  short_types.vocab().token_types.pop_back();
  refused(short_types, "255 token types for 256 tokens");

  TinyVocab bad_type;
  bad_type.vocab().token_types[3] = 7;
  refused(bad_type, "token 3 has type 7");

  TinyVocab no_space;
  no_space.vocab().merges.push_back("ab");
  refused(no_space, "merge 0 \"ab\" is not \"left right\"");

  TinyVocab unknown_merge;
  unknown_merge.vocab().merges.push_back("a b");  // "ab" is no token
  refused(unknown_merge, "merge 0 \"a b\" names a token");

  TinyVocab bad_bos;
  bad_bos.vocab().bos_id = 256;
  refused(bad_bos, "bos id 256 outside the vocabulary of 256");
}

TEST(TokenizerTest, RoundTripsAnyBytes) {
  TinyVocab v;
  v.Merge(" ", "a");
  v.Merge("a", "b");
  v.Merge("\xC3", "\xA9");
  v.Add("<|im_end|>", TokenType::kControl);
  std::unique_ptr<Tokenizer> tok = v.Build();
  std::mt19937 rng(11);
  const std::vector<std::string> parts = {
      "a",    "b",          " ",        "  ",           "\n",
      "1",    "'s",         "\xC3\xA9", "\xC3",         "\xA9",
      "\xFF", "<|im_end|>", "<|im_",    "\xE3\x80\x80", "!"};
  for (int round = 0; round < 1000; ++round) {
    std::string text;
    const int n = static_cast<int>(rng() % 12);
    for (int i = 0; i < n; ++i) text += parts[rng() % parts.size()];
    ExpectRoundTrip(*tok, text, true);
    ExpectRoundTrip(*tok, text, false);
  }
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  ExpectRoundTrip(*tok, all, true);
}

TEST(TokenizerTest, ConcurrentEncodesAgree) {
  TinyVocab v;
  const int32_t ab = v.Merge("a", "b");
  const int32_t space_ab = v.Merge(" ", "ab");
  std::unique_ptr<Tokenizer> tok = v.Build();
  std::string text;
  std::vector<int32_t> want;
  for (int i = 0; i < 200; ++i) {
    text += i == 0 ? "ab" : " ab";
    want.push_back(i == 0 ? ab : space_ab);
    text += std::to_string(i % 10);
    want.push_back('0' + i % 10);
  }
  std::vector<std::thread> threads;
  std::vector<std::vector<int32_t>> got(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 50; ++i) got[t] = tok->Encode(text, false);
    });
  }
  for (std::thread& t : threads) t.join();
  for (const std::vector<int32_t>& ids : got) EXPECT_EQ(ids, want);
}

// ---------------------------------------------------------------------------
// FromGguf on small in-memory files.

// A GGUF v3 file with metadata only (no tensors).
class MetadataWriter {
 public:
  void String(std::string_view key, std::string_view value) {
    Key(key, 8);
    Str(value);
  }
  void Int(std::string_view key, uint32_t value) {
    Key(key, 4);
    Le(value);
  }
  void Strings(std::string_view key, const std::vector<std::string>& values) {
    Key(key, 9);
    Le(uint32_t{8});
    Le(uint64_t{values.size()});
    for (const std::string& v : values) Str(v);
  }
  void Ints(std::string_view key, const std::vector<int32_t>& values) {
    Key(key, 9);
    Le(uint32_t{5});
    Le(uint64_t{values.size()});
    for (const int32_t v : values) Le(v);
  }
  std::string Bytes() const {
    std::string out = "GGUF";
    AppendLe(out, uint32_t{3});
    AppendLe(out, uint64_t{0});  // tensors
    AppendLe(out, count_);
    return out + kvs_;
  }

 private:
  template <typename T>
  static void AppendLe(std::string& out, T value) {
    for (size_t i = 0; i < sizeof(T); ++i) {
      out.push_back(
          static_cast<char>((static_cast<uint64_t>(value) >> (8 * i)) & 0xFF));
    }
  }
  template <typename T>
  void Le(T value) {
    AppendLe(kvs_, value);
  }
  void Str(std::string_view s) {
    Le(uint64_t{s.size()});
    kvs_.append(s);
  }
  void Key(std::string_view key, uint32_t type) {
    ++count_;
    Str(key);
    Le(type);
  }

  std::string kvs_;
  uint64_t count_ = 0;
};

MetadataWriter TinyGguf(std::string_view model, std::string_view pre) {
  TinyVocab v;
  v.Merge("a", "b");
  v.Add("<|im_end|>", TokenType::kControl);
  MetadataWriter w;
  w.String("tokenizer.ggml.model", model);
  w.String("tokenizer.ggml.pre", pre);
  w.Strings("tokenizer.ggml.tokens", v.vocab().tokens);
  w.Strings("tokenizer.ggml.merges", v.vocab().merges);
  w.Ints("tokenizer.ggml.token_type", v.vocab().token_types);
  w.Int("tokenizer.ggml.bos_token_id", 'B');
  w.Int("tokenizer.ggml.eos_token_id", 257);
  return w;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> FromBytes(std::string bytes) {
  absl::StatusOr<std::unique_ptr<GgufFile>> file =
      GgufFile::FromBytes(std::move(bytes), "tiny.gguf");
  if (!file.ok()) return file.status();
  return Tokenizer::FromGguf(**file);
}

TEST(TokenizerGgufTest, ReadsTheTokenizerKeys) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok =
      FromBytes(TinyGguf("gpt2", "smollm").Bytes());
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->vocab_size(), 258);
  EXPECT_EQ((*tok)->bos_id(), 'B');
  EXPECT_EQ((*tok)->eos_id(), 257);
  EXPECT_EQ((*tok)->pre_tokenizer(), PreTokenizer::kSmolLm);
  EXPECT_EQ((*tok)->Encode("ab<|im_end|>", true), Ids({256, 257}));

  tok = FromBytes(TinyGguf("gpt2", "gpt-2").Bytes());
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->pre_tokenizer(), PreTokenizer::kGpt2);
}

TEST(TokenizerGgufTest, RefusesWhatItDoesNotImplement) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok =
      FromBytes(TinyGguf("llama", "smollm").Bytes());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_PRED2(Contains, tok.status().message(),
               "tokenizer.ggml.model \"llama\"");
  tok = FromBytes(TinyGguf("gpt2", "qwen2").Bytes());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_PRED2(Contains, tok.status().message(),
               "tokenizer.ggml.pre \"qwen2\"");

  MetadataWriter no_tokens;
  no_tokens.String("tokenizer.ggml.model", "gpt2");
  no_tokens.String("tokenizer.ggml.pre", "smollm");
  tok = FromBytes(no_tokens.Bytes());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kNotFound);
  EXPECT_PRED2(Contains, tok.status().message(), "tokenizer.ggml.tokens");
}

// ---------------------------------------------------------------------------
// SmolLM2-135M-Instruct against the Hugging Face reference.

std::string Env(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? "" : value;
}

class SmolLm2Test : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string path = Env("KVKEEP_MODEL");
    if (path.empty() || !std::ifstream(path).good()) {
      GTEST_SKIP() << "model absent: run scripts/fetch-model (KVKEEP_MODEL="
                   << path << ")";
    }
    absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(path);
    ASSERT_TRUE(file.ok()) << file.status();
    file_ = *std::move(file);
    absl::StatusOr<std::unique_ptr<Tokenizer>> tok =
        Tokenizer::FromGguf(*file_);
    ASSERT_TRUE(tok.ok()) << tok.status();
    tok_ = *std::move(tok);
  }

  std::unique_ptr<GgufFile> file_;
  std::unique_ptr<Tokenizer> tok_;
};

TEST_F(SmolLm2Test, ReadsTheVocabulary) {
  EXPECT_EQ(tok_->vocab_size(), 49152);
  EXPECT_EQ(tok_->pre_tokenizer(), PreTokenizer::kSmolLm);
  EXPECT_EQ(tok_->bos_id(), 1);
  EXPECT_EQ(tok_->eos_id(), 2);
  EXPECT_EQ(tok_->token(0), "<|endoftext|>");
  EXPECT_EQ(tok_->token(1), "<|im_start|>");
  EXPECT_EQ(tok_->token(2), "<|im_end|>");
  EXPECT_EQ(tok_->token_type(2), TokenType::kControl);
  EXPECT_EQ(tok_->StopIds(), Ids({0, 2}));
}

// Ids from Hugging Face tokenizers 0.23.3 with SmolLM2's own pre-tokenizer
// (Digits + ByteLevel). The first two are where a tokenizer without the
// Digits step (transformers' GGUF loader) differs: [81, 216, 216, 33] and
// [216, 3351, 127, 104].
TEST_F(SmolLm2Test, PinnedIds) {
  EXPECT_EQ(tok_->Encode("a  1", true), Ids({81, 256, 33}));
  EXPECT_EQ(tok_->Encode("  \xC2\xB2x", true), Ids({256, 19133, 104}));
  EXPECT_EQ(tok_->Encode("Hello, world!", true), Ids({19556, 28, 905, 17}));
  EXPECT_EQ(tok_->Encode("<|im_start|>user\nWhat is 2+2?<|im_end|>\n", true),
            Ids({1, 4093, 198, 1780, 314, 216, 34, 27, 34, 47, 2, 198}));
  EXPECT_EQ(
      tok_->Encode("na\xC3\xAFve caf\xC3\xA9 \xE6\x9D\xB1\xE4\xBA\xAC", true),
      Ids({3546, 46494, 37366, 17097, 247, 126, 16736, 122}));
}

// $KVKEEP_LM_TESTDATA, else the data/ folder beside this source file.
std::string TestDataDir() {
  std::string dir = Env("KVKEEP_LM_TESTDATA");
  if (!dir.empty()) return dir;
  dir = __FILE__;
  return dir.substr(0, dir.find_last_of('/') + 1) + "data";
}

TEST_F(SmolLm2Test, MatchesTheReference) {
  const std::string path = TestDataDir() + "/tokenizer_reference.json";
  std::ifstream in(path);
  ASSERT_TRUE(in.good()) << "cannot read " << path
                         << " (made by tests/lm/make_reference.py)";
  const nlohmann::json reference = nlohmann::json::parse(in);
  const nlohmann::json& cases = reference.at("cases");
  ASSERT_FALSE(cases.empty());
  int matched = 0;
  int as_text = 0;
  for (const nlohmann::json& c : cases) {
    const std::string text = c.at("text").get<std::string>();
    const std::vector<int32_t> want = c.at("ids").get<std::vector<int32_t>>();
    const std::vector<int32_t> got = tok_->Encode(text, true);
    EXPECT_EQ(got, want) << "text: " << nlohmann::json(text).dump();
    bool same = got == want;
    // With an added token's text in it, the case also has the ids of the
    // text tokenized as plain text (HF's split_special_tokens=True).
    if (c.contains("ids_special_as_text")) {
      const std::vector<int32_t> plain = tok_->Encode(text, false);
      const std::vector<int32_t> want_plain =
          c.at("ids_special_as_text").get<std::vector<int32_t>>();
      EXPECT_EQ(plain, want_plain)
          << "text (special tokens as text): " << nlohmann::json(text).dump();
      same = same && plain == want_plain;
      ++as_text;
    }
    matched += same;
    ExpectRoundTrip(*tok_, text, true);
    ExpectRoundTrip(*tok_, text, false);
  }
  std::printf("%d of %zu reference cases match (%d also as plain text)\n",
              matched, cases.size(), as_text);
}

}  // namespace
}  // namespace kvkeep::lm
