#!/usr/bin/env python3
"""Compares kvkeep's language model with the Python reference, at length.

    .cache/venv-reference/bin/python tests/lm/reference_check.py \
        [--kvkeep_lm_logits=build/kvkeep_lm_logits [--tokenize]] [--tol=1e-2]

Always: recomputes the reference (make_reference.py's loaders) for a larger
set of prompts and strings than tests/lm/data holds, and checks that the
committed data still reproduces (same ids, logits within 1e-3).
With --kvkeep_lm_logits=PATH: runs
    PATH --model=GGUF --ids=1,2,3 --out=FILE
which must write float32 little-endian logits [n][vocab] for every position
to FILE, and fails a prompt whose max |logit - reference| exceeds --tol.
With --tokenize as well: runs
    PATH --model=GGUF --tokenize_file=TEXTFILE
which must print the ids of the file's UTF-8 text (no special tokens added,
special-token text matched) comma-separated on one line; ids must be equal.
Prints one line per check and last "N passed, M failed"; exits 0 iff M == 0.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_reference as ref  # noqa: E402

EXTRA_PROMPTS = [
    ("one_token", "Hi"),
    ("digits", "1234567890" * 5),
    ("repetition", "one two three " * 20),
    ("chat_system",
     "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
     "trained by Hugging Face<|im_end|>\n<|im_start|>user\nWrite a haiku "
     "about caches.<|im_end|>\n<|im_start|>assistant\n"),
    ("scripts", " ".join(s for s in ref.TOKENIZER_CORPUS
                         if any(ord(c) > 0x2ff for c in s))),
    ("long_520", " ".join([ref.LONG_PARAGRAPH] * 5)),  # RoPE far out
]


def extra_strings():
    """More strings for the tokenizer: real text and code, edge spacing
    around every corpus string, and seeded random Unicode."""
    out = []
    for path in ("README.md", "tests/lm/make_reference.py", "scripts/fetch-model"):
        full = os.path.join(ref.REPO, path)
        if os.path.exists(full):
            with open(full, encoding="utf-8") as f:
                out += [p for p in f.read().split("\n\n") if p][:80]
    for s in ref.TOKENIZER_CORPUS:
        out += [" " + s, s + " ", "\n" + s + "\n\n", s + s]
    rng = random.Random(20240601)
    ranges = [(0x01, 0x7f), (0x80, 0x24f), (0x370, 0x52f), (0x590, 0x6ff),
              (0x900, 0x97f), (0x3040, 0x30ff), (0x4e00, 0x9fff),
              (0xac00, 0xd7a3), (0x1f300, 0x1faff), (0x300, 0x36f)]
    for _ in range(60):
        chars = []
        for _ in range(rng.randint(1, 40)):
            lo, hi = rng.choice(ranges)
            chars.append(chr(rng.randint(lo, hi)))
        out.append("".join(chars))
    return out


class Report:
    def __init__(self):
        self.passed = self.failed = 0

    def check(self, ok, what):
        print(f"{'PASS' if ok else 'FAIL'} {what}", flush=True)
        if ok:
            self.passed += 1
        else:
            self.failed += 1


def short(error):
    if isinstance(error, subprocess.CalledProcessError):
        return f"exit status {error.returncode}"
    return str(error)


def load_json(name):
    with open(os.path.join(ref.DATA_DIR, name), encoding="utf-8") as f:
        return json.load(f)


def check_committed_data(rep, model_path, tok, model):
    facts = ref.model_facts(model_path)
    want = load_json("model_facts.json")
    rep.check(all(facts[k] == v for k, v in want.items() if k != "generator"),
              "model_facts.json reproduces")
    want = load_json("tokenizer_reference.json")
    bad = [c["text"] for c in want["cases"] if ref.encode(tok, c["text"]) != c["ids"]]
    rep.check(not bad, f"tokenizer_reference.json reproduces ({len(bad)} differ)")
    want = load_json("logits_reference.json")
    worst = 0.0
    for case in want["cases"]:
        same_ids = ref.encode(tok, case["text"]) == case["ids"]
        logits = ref.all_logits(model, case["ids"])
        for row in case["rows"]:
            got = logits[row["position"]][row["ids"]].tolist()
            worst = max([worst] + [abs(a - b) for a, b in zip(got, row["logits"])])
        rep.check(same_ids, f"logits_reference.json ids of {case['name']} reproduce")
    rep.check(worst <= 1e-3, f"logits_reference.json logits reproduce "
              f"(max |diff| {worst:.2e})")


def run_logits(binary, model_path, ids, vocab):
    import numpy as np
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "logits.f32")
        subprocess.run([binary, f"--model={model_path}",
                        "--ids=" + ",".join(map(str, ids)), f"--out={out}"],
                       check=True)
        data = np.fromfile(out, dtype="<f4")
    if data.size != len(ids) * vocab:
        raise ValueError(f"{data.size} floats, want {len(ids)} x {vocab}")
    return data.reshape(len(ids), vocab)


def run_tokenize(binary, model_path, text):
    with tempfile.NamedTemporaryFile("wb", suffix=".txt") as f:
        f.write(text.encode("utf-8"))
        f.flush()
        res = subprocess.run([binary, f"--model={model_path}",
                              f"--tokenize_file={f.name}"],
                             check=True, capture_output=True, text=True)
    lines = res.stdout.splitlines()
    line = lines[-1].strip() if lines else ""
    return [int(x) for x in line.split(",")] if line else []


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=ref.DEFAULT_MODEL)
    ap.add_argument("--kvkeep_lm_logits", default=None,
                    help="kvkeep binary that writes logits (and tokenizes)")
    ap.add_argument("--tokenize", action="store_true",
                    help="also compare the binary's --tokenize_file ids")
    ap.add_argument("--tol", type=float, default=1e-2,
                    help="largest |logit difference| a prompt may have")
    args = ap.parse_args()
    if not os.path.exists(args.model):
        sys.exit(f"{args.model} is missing: run scripts/fetch-model")
    if args.tokenize and not args.kvkeep_lm_logits:
        sys.exit("--tokenize needs --kvkeep_lm_logits")

    import numpy as np
    rep = Report()
    tok = ref.load_tokenizer(args.model)
    model = ref.load_model(args.model)
    vocab = model.config.vocab_size
    check_committed_data(rep, args.model, tok, model)

    strings = ref.TOKENIZER_CORPUS + extra_strings()
    print(f"reference tokenizes {len(strings)} strings, "
          f"{sum(len(ref.encode(tok, s)) for s in strings)} tokens")
    if args.tokenize:
        for i, s in enumerate(strings):
            want = ref.encode(tok, s)
            try:
                got = run_tokenize(args.kvkeep_lm_logits, args.model, s)
            except (subprocess.CalledProcessError, ValueError) as e:
                rep.check(False, f"tokenize #{i} {s[:30]!r}: {short(e)}")
                continue
            at = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b),
                      min(len(got), len(want)))
            rep.check(got == want, f"tokenize #{i} {s[:30]!r}" + (
                "" if got == want else
                f": first difference at {at}: got {got[at:at + 5]} want {want[at:at + 5]}"))

    for name, text in ref.LOGITS_PROMPTS + EXTRA_PROMPTS:
        ids = ref.encode(tok, text)
        want = ref.all_logits(model, ids).numpy()
        top = tok.decode([int(want[-1].argmax())])
        print(f"reference {name}: {len(ids)} tokens, next {top!r}")
        if not args.kvkeep_lm_logits:
            continue
        try:
            got = run_logits(args.kvkeep_lm_logits, args.model, ids, vocab)
        except (subprocess.CalledProcessError, ValueError) as e:
            rep.check(False, f"logits {name}: {short(e)}")
            continue
        diff = np.abs(got.astype(np.float64) - want)
        worst = float(np.nanmax(diff)) if np.isfinite(got).all() else float("inf")
        pos = int(diff.max(axis=1).argmax())
        agree = int((got.argmax(axis=1) == want.argmax(axis=1)).sum())
        rep.check(worst <= args.tol,
                  f"logits {name}: {len(ids)} tokens, max |diff| {worst:.3e} "
                  f"(at position {pos}), argmax agrees at {agree}/{len(ids)}")

    print(f"{rep.passed} passed, {rep.failed} failed")
    sys.exit(0 if rep.failed == 0 else 1)


if __name__ == "__main__":
    main()
