#!/usr/bin/env bash
# KIVI's per-channel int4 keys against the store's per-token int4 at the same
# bits, and int2 both ways (is it usable?), on the real model (issue 17's
# granularity and int2 questions; docs/quantization.md): full-cache perplexity of SmolLM2-135M on the first
# TOKENS tokens of Genesis with kvkeep-lm's local cache emulating each format
# (--emulate: float32 arenas holding what the format's CPU twins give back;
# services/lm/emulated_kv.h), beside the local f32 and bf16 caches. One
# kvkeep-lm perplexity --local per format; JSON into OUT, then a table.
#
#   bench/lm/kivi_emulated.sh [TOKENS=1024] [OUT=bench/results/quant]
# KVS="f32 bf16" and FORMATS="int8/g32 ..." pick some (the first of KVS is
# the baseline). kivi_int4/gG/tT/store is KIVI as kvkeepd's kivi_int4 layout
# holds it: the open page's keys quantised as it fills (no bf16 window).
# Needs build/bin/kvkeep-lm, the model (scripts/fetch-model) and the text
# (scripts/fetch-text). No kvkeepd.
set -euo pipefail
cd "$(dirname "$0")/../.."
tokens="${1:-1024}"
out="${2:-bench/results/quant}"
text=.cache/text/genesis-kjv.txt
model=.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
[ -r "$text" ] || { echo "no $text: run scripts/fetch-text" >&2; exit 1; }
[ -r "$model" ] || { echo "no $model: run scripts/fetch-model" >&2; exit 1; }
mkdir -p "$out"
lm() {
  build/bin/kvkeep-lm perplexity --local --model="$model" --text="$text" \
    --max_tokens="$tokens" --json "$@"
}
files=()
for kv in ${KVS:-f32 bf16}; do
  echo "== $kv" >&2
  lm --kv_dtype=$kv >"$out/emulated-$kv-$tokens.json"
  files+=("$out/emulated-$kv-$tokens.json")
done
for f in ${FORMATS:-int8/g32 int4/g32 kivi_int4/g32/t32 kivi_int4/g32/t16 \
  kivi_int4/g32/t16/store int4/g16 kivi_int4/g16/t16 int2/g32 \
  kivi_int2/g32/t32 int2/g16 kivi_int2/g16/t16}; do
  name="$(tr / - <<<"$f")"
  echo "== $f (emulated)" >&2
  lm --emulate="$f" >"$out/emulated-$name-$tokens.json"
  files+=("$out/emulated-$name-$tokens.json")
done
python3 - "$tokens" "${files[@]}" <<'PY'
import json, sys
tokens, files = sys.argv[1], sys.argv[2:]
rows = [json.load(open(f))[0] for f in files]
f32 = rows[0]["perplexity"]
mib = lambda b: b / 2**20
print(f"Full-cache perplexity, {tokens} tokens of Genesis, kvkeep-lm --local\n")
print("| cache | perplexity | vs f32 | KV bytes held | bits per element |")
print("|---|---|---|---|---|")
for r in rows:
    # SmolLM2-135M: 30 layers, keys and values of 3 x 64 elements a token.
    elems = r["resident_tokens_per_layer"] * 30 * 2 * 192
    print(f"| {r['kv_format']} | {r['perplexity']:.4f} | "
          f"{r['perplexity'] - f32:+.4f} | {mib(r['resident_kv_bytes']):.2f} MiB | "
          f"{8 * r['resident_kv_bytes'] / elems:.3f} |")
PY
