#!/usr/bin/env python3
"""Writes the reference data of the real-model tests (tests/lm/data/).

    scripts/fetch-model && scripts/reference-env
    .cache/venv-reference/bin/python tests/lm/make_reference.py

The reference is transformers (tokenizer and LlamaForCausalLM built from the
GGUF file; the weights dequantised to float32 by the gguf package) run by
torch on the CPU in float32. Writes, into --out_dir:
  model_facts.json          the GGUF's metadata and tensor types
  tokenizer_reference.json  ids of a varied corpus, add_special_tokens=False
  logits_reference.json     a few logits rows of a few prompts, plus logsumexp
tests/lm/reference_check.py imports this file for the corpus, the prompts and
the loaders.
"""
import argparse
import collections
import hashlib
import json
import os
import re
import sys

GENERATOR = ".cache/venv-reference/bin/python tests/lm/make_reference.py"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL = os.environ.get(
    "KVKEEP_MODEL", os.path.join(REPO, ".cache", "models", MODEL_NAME))
DATA_DIR = os.path.join(REPO, "tests", "lm", "data")

LONG_PARAGRAPH = (
    "The history of computing is longer than the history of computing "
    "hardware and modern computing technology and includes the history of "
    "methods intended for pen and paper or for chalk and slate, with or "
    "without the aid of tables. Digital computing is intimately tied to the "
    "representation of numbers. But long before abstractions like the number "
    "arose, there were mathematical concepts to serve the purposes of "
    "civilization. These concepts are implicit in concrete practices such as "
    "one-to-one correspondence, the basis of counting, and comparison to a "
    "standard, used for measurement.")

# Strings the tokenizer must split exactly as the reference does. Each entry
# is there for a reason; keep the reasons when adding more.
TOKENIZER_CORPUS = [
    "",
    "Hello world",
    "Hello, world! How are you today?",
    " leading space",
    "trailing space ",
    "The quick brown fox jumps over the lazy dog.",
    # Contractions, lower and upper case (the pre-tokenizer matches 's 't ...
    # case-sensitively).
    "it's don't we're they've I'm you'll he'd",
    "IT'S DON'T WE'RE THEY'VE I'M YOU'LL HE'D",
    "Mixed: It'S dOn'T 'tis rock'n'roll '' 's",
    # Numbers: the vocabulary has single digits only.
    "0 1 12 123 1234 12345",
    # Whitespace before a digit: the digit split comes first, so the spaces
    # stay one run ("a  1" -> "a", "  ", "1").
    "a  1",
    "x   2024\t\t7\n\n8  ",
    "  42  ",
    "3.14159265358979323846 and -42, 1e-5, 0x1F, 1,000,000",
    "31415926535897932384626433832795028841971693993751058209749445923",
    "v1.2.3-rc4 2024-06-30T12:34:56Z abc123def",
    # Code, indentation, tabs.
    "def f(x):\n    return x * 2\n",
    "int main() {\n\tprintf(\"hi\\n\");\n\treturn 0;\n}\n",
    "for (int i = 0; i < n; ++i) {\n        a[i] += b[i];\n}",
    "if x:\n\tif y:\n\t\tz = {'a': [1, 2], \"b\": None}  # comment\n",
    "<div class=\"x\">&nbsp;</div> https://example.com/a?b=c&d=e#f",
    # Whitespace runs.
    "\n",
    "\n\n\n",
    "   x",
    "a  b   c    d",
    "line one\nline two\r\nline three\n\nend",
    "trailing whitespace   \n  \n\t \n",
    " \t \t\t  ",
    "x\n\n\n\ny    \n    z",
    # Punctuation runs.
    "!!! ??? ... --- *** ### $$$ %%% ^^^ &&& ((( ))) ;;; :::",
    "Wait...what?!?! (really) [yes] {no} <maybe> \"quote\" 'single' `tick`",
    "@user #tag ~/path/to/file.txt C:\\Windows\\System32 a/b\\c|d",
    # Latin with accents, other scripts.
    "Café naïve façade résumé coöperate Ångström Ærø Øresund",
    "Größe Straße ÄÖÜ äöü ß ẞ",
    "Ελληνικά: Καλημέρα κόσμε",
    "Русский текст: Привет, мир!",
    "العربية: مرحبا بالعالم",
    "עברית: שלום עולם",
    "हिन्दी: नमस्ते दुनिया",
    "中文：你好，世界。",
    "日本語：こんにちは、カタカナ、ｶﾀｶﾅ",
    "한국어: 안녕하세요 세계",
    "ไทย: สวัสดีชาวโลก",
    # Emoji: single, ZWJ sequences, skin tones, flags, variation selectors.
    "Emoji 😀 🎉 🚀",
    "👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 👍🏽 thumbs",
    "🇫🇷🇯🇵 ❤️ ☺︎ ✔",
    # Combining marks (decomposed forms are not normalised).
    "e\u0301 a\u0308 n\u0303 o\u0302\u0323",
    "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319a\u0341lgo",
    # Control characters (no NUL), odd spaces.
    "bell\x07 escape\x1b[0m delete\x7f",
    "nbsp\u00a0thin\u2009zero\u200bwidth\u2028sep\u3000ideo",
    # Chat special tokens, alone and in text.
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?"
    "<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text before <|im_end|> and after",
    "<|im_start|><|im_end|><|endoftext|>",
    "< |im_start| > <|im_start <|IM_START|>",
    "<filename>main.py<file_sep><gh_stars>",
    LONG_PARAGRAPH,
]

# Prompts whose logits are recorded in logits_reference.json.
LOGITS_PROMPTS = [
    ("short_english", "The capital of France is"),
    ("paragraph", LONG_PARAGRAPH.split(" These")[0]),  # 73 tokens
    ("code", "def fibonacci(n):\n    if n < 2:\n        return n\n    return"),
    ("unicode", "Привет! 你好 👋 Café — naïve"),
    ("chat", "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
             "<|im_start|>assistant\n"),
]

# Vocabulary ids whose logits every row records, whatever the top-10 is.
PROBE_IDS = [0, 1, 2, 17, 33, 198, 216, 260, 314, 1116,
             4093, 6004, 19556, 30000, 49150, 49151]
TOP_K = 10


def short_float(x):
    """The shortest decimal that reads back as the same float32."""
    import numpy as np
    return float(np.format_float_positional(np.float32(x), unique=True))


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def versions(*names):
    import importlib.metadata as md
    return " / ".join(f"{n} {md.version(n)}" for n in names)


def load_tokenizer(model):
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(
        os.path.dirname(model), gguf_file=os.path.basename(model))
    # transformers' GGUF loader ignores tokenizer.ggml.pre = "smollm" and
    # builds GPT-2's plain pre-tokenizer; SmolLM2's own tokenizer.json (and
    # llama.cpp's "smollm") split every digit off first. They differ where
    # whitespace precedes a digit ("a  1").
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    return tok


def load_model(model):
    import torch
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(model), gguf_file=os.path.basename(model),
        dtype=torch.float32)
    return m.eval()


def encode(tok, text, split_special_tokens=False):
    return tok(text, add_special_tokens=False,
               split_special_tokens=split_special_tokens).input_ids


def all_logits(model, ids):
    """float32 logits [len(ids)][vocab] of one sequence, no cache."""
    import torch
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].to(torch.float32)


def model_facts(path):
    from gguf import GGUFReader
    r = GGUFReader(path)

    def get(key):
        f = r.fields.get(key)
        return None if f is None else f.contents()

    arch = get("general.architecture")
    a = lambda k: get(f"{arch}.{k}")  # noqa: E731
    tensor_types = collections.defaultdict(list)
    tensors = {}
    for t in r.tensors:
        tensor_types[t.tensor_type.name].append(t.name)
        # ne0 first, as in ggml: ne0 is the contiguous (input) dimension.
        tensors[t.name] = {"type": t.tensor_type.name,
                           "ne": [int(n) for n in t.shape]}
    by_kind = collections.defaultdict(set)  # "blk.N.attn_q.weight" -> "attn_q.weight"
    for name, t in tensors.items():
        kind = ".".join(name.split(".")[2:]) if name.startswith("blk.") else name
        by_kind[kind].add(t["type"])
    token_types = collections.Counter(get("tokenizer.ggml.token_type"))
    tokens = get("tokenizer.ggml.tokens")
    return {
        "generator": GENERATOR,
        "reference": versions("gguf"),
        "file": MODEL_NAME,
        "sha256": sha256_file(path),
        "gguf_version": get("GGUF.version"),
        "alignment": get("general.alignment") or 32,
        "general.architecture": arch,
        "general.name": get("general.name"),
        "general.file_type": get("general.file_type"),
        "general.quantization_version": get("general.quantization_version"),
        "block_count": a("block_count"),
        "context_length": a("context_length"),
        "embedding_length": a("embedding_length"),
        "feed_forward_length": a("feed_forward_length"),
        "head_count": a("attention.head_count"),
        "head_count_kv": a("attention.head_count_kv"),
        "rope.dimension_count": a("rope.dimension_count"),
        "rope.freq_base": a("rope.freq_base"),
        "layer_norm_rms_epsilon": a("attention.layer_norm_rms_epsilon"),
        "vocab_size": a("vocab_size"),
        "tokenizer.ggml.model": get("tokenizer.ggml.model"),
        "tokenizer.ggml.pre": get("tokenizer.ggml.pre"),
        "tokenizer.ggml.tokens": len(tokens),
        "tokenizer.ggml.merges": len(get("tokenizer.ggml.merges")),
        "tokenizer.ggml.token_type_counts": {str(k): v for k, v in
                                             sorted(token_types.items())},
        "control_tokens": {tokens[i]: i for i, t in
                           enumerate(get("tokenizer.ggml.token_type")) if t == 3},
        "bos_token_id": get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": get("tokenizer.ggml.eos_token_id"),
        "unknown_token_id": get("tokenizer.ggml.unknown_token_id"),
        "padding_token_id": get("tokenizer.ggml.padding_token_id"),
        "add_bos_token": get("tokenizer.ggml.add_bos_token"),
        "add_eos_token": get("tokenizer.ggml.add_eos_token"),
        "add_space_prefix": get("tokenizer.ggml.add_space_prefix"),
        "has_chat_template": get("tokenizer.chat_template") is not None,
        "has_output_weight": "output.weight" in tensors,
        "tensor_count": len(tensors),
        "tensor_type_counts": {k: len(v) for k, v in sorted(tensor_types.items())},
        "tensor_types_by_kind": {k: sorted(v) for k, v in sorted(by_kind.items())},
        "tensors_outside_blocks": {k: v for k, v in tensors.items()
                                   if not k.startswith("blk.")},
        "tensors_of_blk.0": {k: v for k, v in tensors.items()
                             if k.startswith("blk.0.")},
        "metadata_keys": [k for k in r.fields if not k.startswith("GGUF.")],
    }


def hyper_parameters(config):
    rope = getattr(config, "rope_parameters", None) or {}
    return {
        "num_hidden_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": getattr(config, "head_dim", None),
        "intermediate_size": config.intermediate_size,
        "rope_theta": rope.get("rope_theta", getattr(config, "rope_theta", None)),
        "rope_type": rope.get("rope_type"),
        "rms_norm_eps": config.rms_norm_eps,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_position_embeddings,
        "hidden_act": config.hidden_act,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
    }


def tokenizer_cases(tok, corpus):
    cases = []
    for text in corpus:
        case = {"text": text, "ids": encode(tok, text)}
        if any(s in text for s in tok.added_tokens_encoder):
            case["ids_special_as_text"] = encode(tok, text, split_special_tokens=True)
        cases.append(case)
    return cases


def tokenizer_reference(tok):
    added = {t: i for t, i in sorted(tok.added_tokens_encoder.items(),
                                     key=lambda x: x[1])}
    im_start = added.get("<|im_start|>")
    split = encode(tok, "<|im_start|>") == [im_start]
    return {
        "generator": GENERATOR,
        "reference": versions("transformers", "tokenizers")
                     + " (tokenizer built from the GGUF)",
        "add_special_tokens": False,
        "special_tokens_in_text": (
            "matched: each added token (the GGUF's control tokens, listed in "
            "added_tokens) found in the text becomes its one id, with no "
            "lstrip/rstrip of neighbouring spaces; the text between them is "
            "tokenised as plain text" if split else "not matched"),
        "special_tokens_matched": split,
        "ids_special_as_text": (
            "present on cases that contain an added token's text: the ids "
            "when special tokens are not matched (split_special_tokens=True),"
            " i.e. the text tokenised as plain text"),
        "added_tokens": added,
        "pre_tokenizer": json.loads(tok.backend_tokenizer.to_str())["pre_tokenizer"],
        "cases": tokenizer_cases(tok, TOKENIZER_CORPUS),
    }


def logits_rows(logits, positions):
    import torch
    rows = []
    for p in positions:
        row = logits[p]
        top = torch.topk(row, TOP_K).indices.tolist()
        ids = top + [i for i in PROBE_IDS if i not in top]
        rows.append({
            "position": p,
            "ids": ids,
            "logits": [short_float(row[i]) for i in ids],
            "logsumexp": float(torch.logsumexp(row.double(), 0)),
        })
    return rows


def logits_reference(model, tok, model_path, add_bos):
    import torch
    cases = []
    for name, text in LOGITS_PROMPTS:
        ids = ([tok.bos_token_id] if add_bos else []) + encode(tok, text)
        logits = all_logits(model, ids)
        n = len(ids)
        positions = sorted({0, n // 2, n - 1})
        cases.append({"name": name, "text": text, "ids": ids,
                      "rows": logits_rows(logits, positions)})
    return {
        "generator": GENERATOR,
        "reference": versions("transformers", "torch", "gguf"),
        "model": MODEL_NAME,
        "model_sha256": sha256_file(model_path),
        "dtype": "float32",
        "add_bos_token": add_bos,
        "notes": ("ids: the reference tokenizer's, add_special_tokens=False, "
                  "nothing prepended (the GGUF's add_bos_token is false). "
                  "Each row: the top-10 ids of that position, then the probe "
                  "ids not among them; logits in float32; logsumexp over the "
                  "whole vocabulary, computed in float64. Positions are "
                  "0-based; row p is the logits after reading ids[0..p]."),
        "hyper_parameters": hyper_parameters(model.config),
        "probe_ids": PROBE_IDS,
        "torch_threads": torch.get_num_threads(),
        "cases": cases,
    }


def write_json(path, obj):
    """Indented, but each list of numbers on one line."""
    text = json.dumps(obj, ensure_ascii=False, indent=1)
    text = re.sub(r"\[\s*([-+.\deE,\s]*?)\s*\]",
                  lambda m: "[" + re.sub(r",\s+", ", ", m.group(1)) + "]", text)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text + "\n")
    print(f"wrote {path} ({os.path.getsize(path)} bytes)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--out_dir", default=DATA_DIR)
    args = ap.parse_args()
    if not os.path.exists(args.model):
        sys.exit(f"{args.model} is missing: run scripts/fetch-model")
    os.makedirs(args.out_dir, exist_ok=True)

    facts = model_facts(args.model)
    write_json(os.path.join(args.out_dir, "model_facts.json"), facts)
    tok = load_tokenizer(args.model)
    write_json(os.path.join(args.out_dir, "tokenizer_reference.json"),
               tokenizer_reference(tok))
    model = load_model(args.model)
    write_json(os.path.join(args.out_dir, "logits_reference.json"),
               logits_reference(model, tok, args.model,
                                bool(facts["add_bos_token"])))


if __name__ == "__main__":
    main()
