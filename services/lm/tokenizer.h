// Tokenizer is the byte-level BPE tokenizer of a GGUF model whose
// `tokenizer.ggml.model` is "gpt2" (SmolLM2's kind): text to token ids and
// back, giving the ids the model's Hugging Face tokenizer gives.
//
// Encode(text, parse_special) works in three steps.
//  1. Special tokens. User-defined tokens (type 4) and, with parse_special,
//     control tokens (type 3, like <|im_start|>) are found in the text by
//     their literal text, leftmost first and the longest of those starting
//     at one place, and become their ids; the text between them goes on
//     alone to step 2, so no piece spans a special token. Without
//     parse_special a control token's text is tokenized as plain text.
//  2. Pre-tokenization into pieces (PreTokenize below): for kSmolLm every
//     numeric code point is a piece of its own (HF's Digits with
//     individual_digits), then GPT-2's regex
//       's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|
//       \s+(?!\S)|\s+
//     cuts each piece further ("a   b" -> "a", "  ", " b"); kGpt2 is the
//     regex alone. The Unicode classes are the reference's own
//     (unicode_classes.h).
//  3. Byte-level BPE. Each piece's bytes start as byte tokens (the vocabulary
//     spells byte b as GPT-2's bytes_to_unicode(b)); the adjacent pair whose
//     merge has the lowest rank (its index in the merges; the leftmost among
//     equals) is merged until no pair has a merge, as Hugging Face's BPE
//     does. A byte that has no token is dropped before merging, as Hugging
//     Face's BPE without an unknown token (and llama.cpp) drops it: SmolLM2
//     has none for the control bytes 04 06 13 14 16 1D and for C0 C1 F1 F2
//     F5..FF, which valid UTF-8 never holds or only for unassigned planes.
//     Results are cached per piece.
// Text that is not valid UTF-8 is still encoded: a byte that does not belong
// to a valid sequence counts as one code point in no class (like
// punctuation) and goes through as its byte token, so Decode(Encode(s, p))
// == s for every byte string s whose bytes all have tokens. (Hugging Face
// refuses such text; llama.cpp replaces each such byte with U+FFFD.)
//
// Decode(ids) concatenates the bytes of the tokens: for a special (control
// or user-defined) token its literal text, for any other the inverse of the
// byte mapping. The result need not be valid UTF-8 when the ids split a
// character (as in streamed output).
//
// Thread-safety: immutable after construction apart from the piece cache,
// which has its own lock; every const method is thread-safe.
#ifndef KVKEEP_SERVICES_LM_TOKENIZER_H_
#define KVKEEP_SERVICES_LM_TOKENIZER_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "services/lm/gguf.h"

namespace kvkeep::lm {

// llama.cpp's token types (`tokenizer.ggml.token_type`).
enum class TokenType : int32_t {
  kUndefined = 0,
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,
  kUserDefined = 4,
  kUnused = 5,
  kByte = 6,
};

// How text is cut into pieces before BPE (`tokenizer.ggml.pre`).
enum class PreTokenizer {
  kGpt2,    // "gpt-2": GPT-2's regex
  kSmolLm,  // "smollm": numeric code points alone, then GPT-2's regex
};

// Cuts `text` into the pieces that BPE encodes one by one (step 2 above).
// The pieces are views into `text`, in order, and concatenate to it.
std::vector<std::string_view> PreTokenize(std::string_view text,
                                          PreTokenizer pre_tokenizer);

// What a byte-level BPE tokenizer is built from: GGUF's arrays, as plain
// vectors.
struct TokenizerVocab {
  // Token id -> text, spelled as GPT-2's byte-level vocabularies spell it
  // (bytes_to_unicode); a token with a character outside that alphabet
  // stands for its own UTF-8 bytes. Encode drops a byte without a token.
  std::vector<std::string> tokens;
  // "left right": the merge of two tokens into the token left+right, which
  // must exist. Rank = index; a lower rank merges first.
  std::vector<std::string> merges;
  // TokenType values, one per token; empty means all normal.
  std::vector<int32_t> token_types;
  PreTokenizer pre_tokenizer = PreTokenizer::kSmolLm;
  int32_t bos_id = -1;  // -1: none
  int32_t eos_id = -1;  // -1: none
};

class Tokenizer {
 public:
  // Checks `vocab` and builds the tokenizer. INVALID_ARGUMENT, naming the
  // culprit, for: no tokens or more than INT32_MAX, a token_types array of
  // another length or with a value outside TokenType, a merge that is not "left
  // right" or whose left, right or left+right is not a token, a bos or eos id
  // out of range.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Create(
      TokenizerVocab vocab);

  // Builds the tokenizer a GGUF file describes: tokenizer.ggml.tokens,
  // .merges, .token_type (optional), .bos_token_id and .eos_token_id
  // (optional). UNIMPLEMENTED naming the value when tokenizer.ggml.model is
  // not "gpt2" or tokenizer.ggml.pre is not "smollm" or "gpt-2"; the
  // metadata's own errors (NOT_FOUND naming a missing key, INVALID_ARGUMENT
  // for a wrong type) and Create's.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromGguf(
      const GgufFile& gguf);

  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;
  ~Tokenizer();

  // The ids of `text` (see the file comment). Never fails. Adds no BOS or
  // EOS.
  std::vector<int32_t> Encode(std::string_view text, bool parse_special) const;

  // The bytes `ids` stand for. INVALID_ARGUMENT naming the first id outside
  // [0, vocab_size()).
  absl::StatusOr<std::string> Decode(absl::Span<const int32_t> ids) const;

  int32_t vocab_size() const { return static_cast<int32_t>(tokens_.size()); }
  // The token's text as the vocabulary spells it; "" for an id out of range.
  std::string_view token(int32_t id) const;
  // kUndefined for an id out of range.
  TokenType token_type(int32_t id) const;
  int32_t bos_id() const { return bos_id_; }  // -1: none
  int32_t eos_id() const { return eos_id_; }  // -1: none
  // The ids that end generation, ascending: eos and every control token
  // whose text ends a turn or a document in a known chat format
  // (<|endoftext|>, <|im_end|>, <|eot_id|>, <|eom_id|>, <|end|>,
  // <end_of_turn>), like llama.cpp's end-of-generation set. For
  // SmolLM2-Instruct: <|endoftext|> (0) and <|im_end|> (2, its eos).
  const std::vector<int32_t>& StopIds() const { return stop_ids_; }
  PreTokenizer pre_tokenizer() const { return pre_tokenizer_; }

 private:
  struct Merge {
    int32_t rank;
    int32_t merged_id;
  };
  struct Special {
    std::string text;
    int32_t id;
    bool control;  // matched only with parse_special
  };

  Tokenizer() = default;

  // Appends the BPE ids of one piece.
  void EncodePiece(std::string_view piece, std::vector<int32_t>& out) const;
  void Bpe(std::string_view piece, std::vector<int32_t>& out) const;
  // Appends the ids of `text`, which holds no special token.
  void EncodeText(std::string_view text, std::vector<int32_t>& out) const;

  static uint64_t PairKey(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) |
           static_cast<uint32_t>(right);
  }

  std::vector<std::string> tokens_;   // as spelled in the vocabulary
  std::vector<std::string> decoded_;  // id -> the bytes Decode writes
  std::vector<TokenType> types_;
  int32_t byte_ids_[256] = {};                   // byte -> its token; -1: none
  absl::flat_hash_map<uint64_t, Merge> merges_;  // PairKey(left, right)
  std::vector<Special> specials_;
  std::vector<int32_t> stop_ids_;
  PreTokenizer pre_tokenizer_ = PreTokenizer::kSmolLm;
  int32_t bos_id_ = -1;
  int32_t eos_id_ = -1;

  // Piece bytes -> ids, for pieces up to kMaxCachedPieceBytes; emptied when
  // it reaches kMaxCacheEntries.
  static constexpr size_t kMaxCachedPieceBytes = 64;
  static constexpr size_t kMaxCacheEntries = 1 << 16;
  mutable absl::Mutex cache_mu_;
  mutable absl::flat_hash_map<std::string, std::vector<int32_t>> cache_
      ABSL_GUARDED_BY(cache_mu_);
};

}  // namespace kvkeep::lm

#endif  // KVKEEP_SERVICES_LM_TOKENIZER_H_
