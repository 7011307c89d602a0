#!/usr/bin/env bash
# The first quantisation x eviction frontier of issue 17 on the real model:
# perplexity of SmolLM2-135M on the first TOKENS tokens of Genesis (KJV,
# scripts/fetch-text) for every KV layout of bench/lm/kvkeepd.json (f32, bf16,
# fp8_e4m3, int8, int4; groups of 32; DTYPES="f32 bf16 ..." picks some) x {full, h2o, streaming_llm} at two
# budgets (a quarter and an eighth of the text), one kvkeep-lm perplexity
# batch per layout, with the KV bytes the store really holds at the end
# (SessionStats.resident_bytes). JSON per layout into OUT, then a table.
#
#   bench/lm/quant_frontier.sh [TOKENS=1024] [OUT=bench/results/quant]
# Needs build/bin (kvkeepd, kvkeep-lm), the model (scripts/fetch-model) and
# the text (scripts/fetch-text). KVKEEPD=PATH runs another kvkeepd binary;
# CACHE=mapped|mirror (default auto: mapped) picks how kvkeep-lm reads.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/lib.sh
tokens="${1:-1024}"
out="${2:-bench/results/quant}"
text=.cache/text/genesis-kjv.txt
[ -r "$text" ] || { echo "no $text: run scripts/fetch-text" >&2; exit 1; }
mkdir -p "$out"
log="$(mktemp)"
trap 'kill $KVKEEPD_PID 2>/dev/null || true; rm -f "$log"' EXIT
kvkeep_start_kvkeepd "${KVKEEPD:-build/bin/kvkeepd}" "$log" \
  --config=bench/lm/kvkeepd.json --listen=127.0.0.1:0 \
  --metrics_listen=127.0.0.1:0 --self_check=false
b1=$((tokens / 4))
b2=$((tokens / 8))
runs="full h2o:sinks=4,recent=$((b1 / 4))@$b1 h2o:sinks=4,recent=$((b2 / 4))@$b2"
runs="$runs streaming_llm:sinks=4@$b1 streaming_llm:sinks=4@$b2"
for dtype in ${DTYPES:-bf16 fp8 int8 int4}; do
  layout=smollm2-135m-$dtype
  [ "$dtype" = f32 ] && layout=smollm2-135m
  echo "== $layout: $runs" >&2
  "${KVKEEP_LM:-build/bin/kvkeep-lm}" perplexity --server="$KVKEEPD_ADDRESS" \
    --layout="$layout" --cache="${CACHE:-auto}" --text="$text" \
    --max_tokens="$tokens" --runs="$runs" --json >"$out/frontier-$dtype-$tokens.json"
done
python3 bench/lm/quant_frontier.py "$out"/frontier-*-"$tokens".json
