#include "services/lm/tokenizer.h"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <queue>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "services/lm/gguf.h"
#include "services/lm/unicode_classes.h"

namespace kvkeep::lm {
namespace {

// ---------------------------------------------------------------------------
// GPT-2's bytes_to_unicode: byte b is spelled as one code point, itself for
// the printable bytes '!'..'~', '¡'..'¬', '®'..'ÿ' and 256 + n for the n-th
// other byte, so that every token is printable text without spaces.

struct ByteAlphabet {
  std::array<char32_t, 256> byte_to_cp{};
  std::array<int16_t, 324> cp_to_byte{};  // -1: not in the alphabet

  ByteAlphabet() {
    cp_to_byte.fill(-1);
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable =
          (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      byte_to_cp[b] = printable ? b : 256 + n++;
      cp_to_byte[byte_to_cp[b]] = static_cast<int16_t>(b);
    }
  }
};

// Abseil here is built with its own string_view, which StrCat and the
// string-keyed hash maps take.
absl::string_view Absl(std::string_view s) { return {s.data(), s.size()}; }

const ByteAlphabet& Alphabet() {
  static const ByteAlphabet alphabet;
  return alphabet;
}

// Decodes one UTF-8 sequence at text[pos] (pos < size) strictly (no
// overlongs, surrogates or values past U+10FFFF) into `cp`; returns its
// length, or 0 when the byte at pos starts no valid sequence.
size_t DecodeUtf8(std::string_view text, size_t pos, char32_t& cp) {
  const auto byte = [&](size_t i) {
    return static_cast<uint8_t>(text[pos + i]);
  };
  const size_t left = text.size() - pos;
  const uint8_t b0 = byte(0);
  if (b0 < 0x80) {
    cp = b0;
    return 1;
  }
  const auto cont = [&](size_t i) { return (byte(i) & 0xC0) == 0x80; };
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    if (left < 2 || !cont(1)) return 0;
    cp = (char32_t{b0} & 0x1F) << 6 | (byte(1) & 0x3F);
    return 2;
  }
  if (b0 >= 0xE0 && b0 <= 0xEF) {
    if (left < 3 || !cont(1) || !cont(2)) return 0;
    const uint8_t b1 = byte(1);
    if ((b0 == 0xE0 && b1 < 0xA0) || (b0 == 0xED && b1 > 0x9F)) return 0;
    cp = (char32_t{b0} & 0x0F) << 12 | (char32_t{b1} & 0x3F) << 6 |
         (byte(2) & 0x3F);
    return 3;
  }
  if (b0 >= 0xF0 && b0 <= 0xF4) {
    if (left < 4 || !cont(1) || !cont(2) || !cont(3)) return 0;
    const uint8_t b1 = byte(1);
    if ((b0 == 0xF0 && b1 < 0x90) || (b0 == 0xF4 && b1 > 0x8F)) return 0;
    cp = (char32_t{b0} & 0x07) << 18 | (char32_t{b1} & 0x3F) << 12 |
         (char32_t{byte(2)} & 0x3F) << 6 | (byte(3) & 0x3F);
    return 4;
  }
  return 0;
}

// The bytes a vocabulary token stands for: the inverse of bytes_to_unicode
// when every character is in the byte alphabet, else the text's own UTF-8
// (as Hugging Face respells such tokens).
std::string TokenBytes(std::string_view token) {
  const ByteAlphabet& alphabet = Alphabet();
  std::string bytes;
  bytes.reserve(token.size());
  for (size_t pos = 0; pos < token.size();) {
    char32_t cp = 0;
    const size_t len = DecodeUtf8(token, pos, cp);
    if (len == 0 || cp >= alphabet.cp_to_byte.size() ||
        alphabet.cp_to_byte[cp] < 0) {
      return std::string(token);
    }
    bytes.push_back(static_cast<char>(alphabet.cp_to_byte[cp]));
    pos += len;
  }
  return bytes;
}

// Control tokens that end a turn or a document in the chat formats in use.
bool IsEndOfGeneration(std::string_view text) {
  for (const std::string_view stop :
       {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>",
        "<end_of_turn>"}) {
    if (text == stop) return true;
  }
  return false;
}

// ---------------------------------------------------------------------------
// Pre-tokenization.

// One code point of the text: its classes (unicode_classes.h bits; 0 for an
// invalid byte), its value (only compared against ASCII here) and where its
// bytes start.
struct CodePoint {
  char32_t cp;
  uint8_t classes;
  uint32_t offset;
};

uint8_t AsciiClasses(char32_t cp) {
  if ((cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z')) {
    return kUnicodeLetter;
  }
  if (cp >= '0' && cp <= '9') return kUnicodeNumber | kUnicodeNumeric;
  if (cp == ' ' || (cp >= '\t' && cp <= '\r')) return kUnicodeWhitespace;
  return 0;
}

// Decodes `text` into code points; an invalid byte is one code point with no
// class. The last element is a sentinel holding text.size().
std::vector<CodePoint> CodePoints(std::string_view text) {
  std::vector<CodePoint> cps;
  cps.reserve(text.size() + 1);
  for (size_t pos = 0; pos < text.size();) {
    char32_t cp = 0;
    size_t len = DecodeUtf8(text, pos, cp);
    uint8_t classes = 0;
    if (len == 0) {
      len = 1;
      cp = 0xFFFD;
    } else {
      classes = cp < 0x80 ? AsciiClasses(cp) : CodePointClasses(cp);
    }
    cps.push_back({cp, classes, static_cast<uint32_t>(pos)});
    pos += len;
  }
  cps.push_back({0, 0, static_cast<uint32_t>(text.size())});
  return cps;
}

constexpr uint8_t kLetterNumberSpace =
    kUnicodeLetter | kUnicodeNumber | kUnicodeWhitespace;

// The length in code points of GPT-2's regex match at cps[i], i < end; the
// text ends at `end` for the regex (a piece boundary).
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// The alternatives are tried in order, as a backtracking engine does; the
// regex matches at every position, so every code point lands in a piece.
size_t Gpt2Match(const std::vector<CodePoint>& cps, size_t i, size_t end) {
  const auto is = [&](size_t k, uint8_t cls) {
    return k < end && (cps[k].classes & cls) != 0;
  };
  const auto is_other = [&](size_t k) {
    return k < end && (cps[k].classes & kLetterNumberSpace) == 0;
  };
  const auto run = [&](size_t k, auto pred) {
    size_t j = k;
    while (pred(j)) ++j;
    return j - i;
  };
  const char32_t c = cps[i].cp;
  if (c == '\'' && i + 1 < end) {
    const char32_t c1 = cps[i + 1].cp;
    if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return 2;
    if (i + 2 < end) {
      const char32_t c2 = cps[i + 2].cp;
      if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') ||
          (c1 == 'l' && c2 == 'l')) {
        return 3;
      }
    }
  }
  const size_t after_space = c == ' ' ? i + 1 : i;
  const auto letter = [&](size_t k) { return is(k, kUnicodeLetter); };
  const auto number = [&](size_t k) { return is(k, kUnicodeNumber); };
  // " ?X+": the optional space taken when X follows it; else X+ at i.
  if (letter(after_space)) return run(after_space, letter);
  if (number(after_space)) return run(after_space, number);
  if (is_other(after_space)) return run(after_space, is_other);
  // Only a letter, number or other can follow i == after_space, so cps[i] is
  // whitespace here. \s+(?!\S) takes the run, less its last character when
  // something else follows; a run of one before a non-space is \s+.
  const auto space = [&](size_t k) { return is(k, kUnicodeWhitespace); };
  const size_t n = run(i, space);
  if (i + n == end || n == 1) return n;
  return n - 1;
}

void SplitGpt2(std::string_view text, const std::vector<CodePoint>& cps,
               size_t begin, size_t end,
               std::vector<std::string_view>& pieces) {
  for (size_t i = begin; i < end;) {
    const size_t n = Gpt2Match(cps, i, end);
    pieces.push_back(
        text.substr(cps[i].offset, cps[i + n].offset - cps[i].offset));
    i += n;
  }
}

}  // namespace

std::vector<std::string_view> PreTokenize(std::string_view text,
                                          PreTokenizer pre_tokenizer) {
  std::vector<std::string_view> pieces;
  const std::vector<CodePoint> cps = CodePoints(text);
  const size_t n = cps.size() - 1;
  if (pre_tokenizer == PreTokenizer::kGpt2) {
    SplitGpt2(text, cps, 0, n, pieces);
    return pieces;
  }
  // kSmolLm: Digits(individual_digits) isolates each numeric code point,
  // then the regex runs on each stretch between them.
  size_t begin = 0;
  for (size_t i = 0; i < n; ++i) {
    if ((cps[i].classes & kUnicodeNumeric) == 0) continue;
    SplitGpt2(text, cps, begin, i, pieces);
    pieces.push_back(
        text.substr(cps[i].offset, cps[i + 1].offset - cps[i].offset));
    begin = i + 1;
  }
  SplitGpt2(text, cps, begin, n, pieces);
  return pieces;
}

// ---------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Create(
    TokenizerVocab vocab) {
  const size_t n = vocab.tokens.size();
  if (n == 0) return absl::InvalidArgumentError("tokenizer: no tokens");
  if (n > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer: ", n, " tokens, more than INT32_MAX"));
  }
  if (!vocab.token_types.empty() && vocab.token_types.size() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer: ", vocab.token_types.size(),
                     " token types for ", n, " tokens"));
  }
  for (const auto& [name, id] :
       {std::pair<const char*, int32_t>{"bos", vocab.bos_id},
        {"eos", vocab.eos_id}}) {
    if (id < -1 || id >= static_cast<int64_t>(n)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tokenizer: ", name, " id ", id, " outside the vocabulary of ", n));
    }
  }

  auto tok = std::unique_ptr<Tokenizer>(new Tokenizer());
  tok->pre_tokenizer_ = vocab.pre_tokenizer;
  tok->bos_id_ = vocab.bos_id;
  tok->eos_id_ = vocab.eos_id;
  tok->types_.resize(n, TokenType::kNormal);
  tok->decoded_.resize(n);
  // Bytes -> id; a later token with the same bytes wins, as in Hugging
  // Face's vocabulary map.
  absl::flat_hash_map<std::string, int32_t> ids;
  ids.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const int32_t id = static_cast<int32_t>(i);
    if (!vocab.token_types.empty()) {
      const int32_t type = vocab.token_types[i];
      if (type < 0 || type > static_cast<int32_t>(TokenType::kByte)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tokenizer: token ", i, " has type ", type, ", not a token type"));
      }
      tok->types_[i] = static_cast<TokenType>(type);
    }
    const std::string& text = vocab.tokens[i];
    const bool special = tok->types_[i] == TokenType::kControl ||
                         tok->types_[i] == TokenType::kUserDefined;
    tok->decoded_[i] = special ? text : TokenBytes(text);
    ids.insert_or_assign(TokenBytes(text), id);
    if (special && !text.empty()) {
      tok->specials_.push_back(
          {text, id, tok->types_[i] == TokenType::kControl});
    }
  }
  for (int b = 0; b < 256; ++b) {
    const auto it = ids.find(std::string(1, static_cast<char>(b)));
    tok->byte_ids_[b] = it == ids.end() ? -1 : it->second;
  }
  tok->merges_.reserve(vocab.merges.size());
  for (size_t rank = 0; rank < vocab.merges.size(); ++rank) {
    const std::string_view merge = vocab.merges[rank];
    // Tokens hold no space (the alphabet spells it 'Ġ'); searching from 1
    // lets a merge's left token be a literal space all the same.
    const size_t sep = merge.find(' ', 1);
    if (sep == std::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer: merge ", rank, " \"", Absl(merge),
                       "\" is not \"left right\""));
    }
    const std::string left = TokenBytes(merge.substr(0, sep));
    const std::string right = TokenBytes(merge.substr(sep + 1));
    const auto l = ids.find(left);
    const auto r = ids.find(right);
    const auto m = ids.find(left + right);
    if (l == ids.end() || r == ids.end() || m == ids.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer: merge ", rank, " \"", Absl(merge),
                       "\" names a token that is not in the vocabulary"));
    }
    // A repeated pair keeps its last rank, as in Hugging Face's merge map.
    tok->merges_.insert_or_assign(PairKey(l->second, r->second),
                                  Merge{static_cast<int32_t>(rank), m->second});
  }
  if (tok->eos_id_ >= 0) tok->stop_ids_.push_back(tok->eos_id_);
  for (const Special& special : tok->specials_) {
    if (special.control && IsEndOfGeneration(special.text)) {
      tok->stop_ids_.push_back(special.id);
    }
  }
  std::sort(tok->stop_ids_.begin(), tok->stop_ids_.end());
  tok->stop_ids_.erase(
      std::unique(tok->stop_ids_.begin(), tok->stop_ids_.end()),
      tok->stop_ids_.end());
  tok->tokens_ = std::move(vocab.tokens);
  return tok;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromGguf(
    const GgufFile& gguf) {
  absl::StatusOr<std::string> model = gguf.GetString("tokenizer.ggml.model");
  if (!model.ok()) return model.status();
  if (*model != "gpt2") {
    return absl::UnimplementedError(
        absl::StrCat(gguf.name(), ": tokenizer.ggml.model \"", *model,
                     "\" is not supported (only \"gpt2\", byte-level BPE)"));
  }
  absl::StatusOr<std::string> pre = gguf.GetString("tokenizer.ggml.pre");
  if (!pre.ok()) return pre.status();
  TokenizerVocab vocab;
  if (*pre == "smollm") {
    vocab.pre_tokenizer = PreTokenizer::kSmolLm;
  } else if (*pre == "gpt-2") {
    vocab.pre_tokenizer = PreTokenizer::kGpt2;
  } else {
    return absl::UnimplementedError(
        absl::StrCat(gguf.name(), ": tokenizer.ggml.pre \"", *pre,
                     "\" is not supported (only \"smollm\" and \"gpt-2\")"));
  }
  absl::StatusOr<const std::vector<std::string>*> tokens =
      gguf.GetStringArray("tokenizer.ggml.tokens");
  if (!tokens.ok()) return tokens.status();
  vocab.tokens = **tokens;
  absl::StatusOr<const std::vector<std::string>*> merges =
      gguf.GetStringArray("tokenizer.ggml.merges");
  if (!merges.ok()) return merges.status();
  vocab.merges = **merges;
  absl::StatusOr<const std::vector<int64_t>*> types =
      gguf.GetIntArray("tokenizer.ggml.token_type");
  if (types.ok()) {
    vocab.token_types.reserve((*types)->size());
    for (const int64_t type : **types) {
      vocab.token_types.push_back(static_cast<int32_t>(
          std::clamp<int64_t>(type, std::numeric_limits<int32_t>::min(),
                              std::numeric_limits<int32_t>::max())));
    }
  } else if (!absl::IsNotFound(types.status())) {
    return types.status();
  }
  for (const auto& [key, id] :
       {std::pair<const char*, int32_t*>{"tokenizer.ggml.bos_token_id",
                                         &vocab.bos_id},
        {"tokenizer.ggml.eos_token_id", &vocab.eos_id}}) {
    absl::StatusOr<int64_t> value = gguf.GetInt(key);
    if (value.ok()) {
      if (*value < 0 || *value >= static_cast<int64_t>(vocab.tokens.size())) {
        return absl::InvalidArgumentError(
            absl::StrCat(gguf.name(), ": ", key, " ", *value,
                         " outside the vocabulary of ", vocab.tokens.size()));
      }
      *id = static_cast<int32_t>(*value);
    } else if (!absl::IsNotFound(value.status())) {
      return value.status();
    }
  }
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Create(std::move(vocab));
  if (!tok.ok()) {
    return absl::Status(
        tok.status().code(),
        absl::StrCat(gguf.name(), ": ", tok.status().message()));
  }
  return tok;
}

Tokenizer::~Tokenizer() = default;

std::string_view Tokenizer::token(int32_t id) const {
  if (id < 0 || id >= vocab_size()) return {};
  return tokens_[id];
}

TokenType Tokenizer::token_type(int32_t id) const {
  if (id < 0 || id >= vocab_size()) return TokenType::kUndefined;
  return types_[id];
}

std::vector<int32_t> Tokenizer::Encode(std::string_view text,
                                       bool parse_special) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 1);
  // next[s]: where specials_[s] next occurs at or after `pos` (npos: never
  // again); recomputed only when `pos` passes it.
  std::vector<size_t> next(specials_.size(), std::string_view::npos);
  for (size_t s = 0; s < specials_.size(); ++s) {
    if (parse_special || !specials_[s].control) {
      next[s] = text.find(specials_[s].text);
    }
  }
  size_t pos = 0;
  while (true) {
    size_t best = specials_.size();
    for (size_t s = 0; s < specials_.size(); ++s) {
      if (next[s] == std::string_view::npos) continue;
      if (best == specials_.size() || next[s] < next[best] ||
          (next[s] == next[best] &&
           specials_[s].text.size() > specials_[best].text.size())) {
        best = s;
      }
    }
    if (best == specials_.size()) break;
    const size_t start = next[best];
    EncodeText(text.substr(pos, start - pos), out);
    out.push_back(specials_[best].id);
    pos = start + specials_[best].text.size();
    for (size_t s = 0; s < specials_.size(); ++s) {
      if (next[s] != std::string_view::npos && next[s] < pos) {
        next[s] = text.find(specials_[s].text, pos);
      }
    }
  }
  EncodeText(text.substr(pos), out);
  return out;
}

void Tokenizer::EncodeText(std::string_view text,
                           std::vector<int32_t>& out) const {
  if (text.empty()) return;
  for (const std::string_view piece : PreTokenize(text, pre_tokenizer_)) {
    EncodePiece(piece, out);
  }
}

void Tokenizer::EncodePiece(std::string_view piece,
                            std::vector<int32_t>& out) const {
  if (piece.size() == 1) {
    const int32_t id = byte_ids_[static_cast<uint8_t>(piece[0])];
    if (id >= 0) out.push_back(id);
    return;
  }
  const bool cacheable = piece.size() <= kMaxCachedPieceBytes;
  if (cacheable) {
    absl::MutexLock lock(&cache_mu_);
    const auto it = cache_.find(Absl(piece));
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = out.size();
  Bpe(piece, out);
  if (cacheable) {
    absl::MutexLock lock(&cache_mu_);
    if (cache_.size() >= kMaxCacheEntries) cache_.clear();
    cache_.try_emplace(Absl(piece), out.begin() + first, out.end());
  }
}

void Tokenizer::Bpe(std::string_view piece, std::vector<int32_t>& out) const {
  // The piece's symbols form a linked list, first one per byte that has a
  // token; a min-heap holds the candidate merges of adjacent symbols by
  // (rank, position), so a piece of n bytes costs O(n log n). An entry is
  // stale when either symbol has changed since it was pushed: the pair it
  // names is checked on pop.
  struct Symbol {
    int32_t id;    // -1: merged into the symbol before it
    int32_t prev;  // -1: none
    int32_t next;  // -1: none
  };
  struct Candidate {
    int32_t rank;
    int32_t pos;
    int32_t left_id;
    int32_t right_id;
    int32_t merged_id;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::vector<Symbol> symbols;
  symbols.reserve(piece.size());
  for (const char ch : piece) {
    const int32_t id = byte_ids_[static_cast<uint8_t>(ch)];
    if (id < 0) continue;
    const int32_t pos = static_cast<int32_t>(symbols.size());
    if (pos > 0) symbols.back().next = pos;
    symbols.push_back({id, pos - 1, -1});
  }
  if (symbols.empty()) return;
  std::vector<Candidate> storage;
  storage.reserve(symbols.size());
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap(
      std::greater<>(), std::move(storage));
  const auto push = [&](int32_t pos) {
    const int32_t next = symbols[pos].next;
    if (next < 0) return;
    const int32_t left_id = symbols[pos].id;
    const int32_t right_id = symbols[next].id;
    const auto it = merges_.find(PairKey(left_id, right_id));
    if (it != merges_.end()) {
      heap.push(
          {it->second.rank, pos, left_id, right_id, it->second.merged_id});
    }
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbols.size()); ++i) {
    push(i);
  }
  while (!heap.empty()) {
    const Candidate top = heap.top();
    heap.pop();
    Symbol& left = symbols[top.pos];
    if (left.id != top.left_id || left.next < 0) continue;
    Symbol& right = symbols[left.next];
    if (right.id != top.right_id) continue;
    left.id = top.merged_id;
    right.id = -1;
    left.next = right.next;
    if (left.next >= 0) symbols[left.next].prev = top.pos;
    if (left.prev >= 0) push(left.prev);
    push(top.pos);
  }
  for (int32_t i = 0; i >= 0; i = symbols[i].next) out.push_back(symbols[i].id);
}

absl::StatusOr<std::string> Tokenizer::Decode(
    absl::Span<const int32_t> ids) const {
  std::string text;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id < 0 || id >= vocab_size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer: id ", id, " at position ", i,
                       " is outside the vocabulary of ", vocab_size()));
    }
    text += decoded_[id];
  }
  return text;
}

}  // namespace kvkeep::lm
