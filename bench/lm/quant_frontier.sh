#!/usr/bin/env bash
# The first quantisation x eviction frontier of issue 17 on the real model:
# perplexity of SmolLM2-135M on the first TOKENS tokens of Genesis (KJV,
# scripts/fetch-text) for every KV layout of bench/lm/kvkeepd.json (f32, bf16,
# fp8_e4m3, int8, int4, kivi_int4; groups of 32; DTYPES="f32 bf16 ..." picks
# some) x {full, h2o, streaming_llm} at two budgets (a quarter and an eighth
# of the text); kivi_int4, which takes full and h2o_page only, x {full,
# h2o_page} at the same budgets, and so does a dtype named DTYPE-page in
# DTYPES ("bf16-page": its baseline, in the same batch of runs, since a
# batch's size moves the digits a little; "bf16-all": bf16 with both sets of
# runs in one batch); one kvkeep-lm perplexity
# batch per layout, with the KV bytes the store really holds at the end
# (SessionStats.resident_bytes). JSON per layout into OUT, then a table.
# CHAPTER=N (default 1) starts the text at Genesis N instead (each chapter
# is one paragraph of the file): another window for the spread, its JSON
# frontier-NAME-TOKENS-chN.json (quant_frontier.py's spread table).
#
#   bench/lm/quant_frontier.sh [TOKENS=1024] [OUT=bench/results/quant]
# Needs build/bin (kvkeepd, kvkeep-lm), the model (scripts/fetch-model) and
# the text (scripts/fetch-text). KVKEEPD=PATH runs another kvkeepd binary;
# CACHE=mapped|mirror (default auto: mapped) picks how kvkeep-lm reads.
set -euo pipefail
cd "$(dirname "$0")/../.."
source bench/lm/quant_lib.sh
tokens="${1:-1024}"
out="${2:-bench/results/quant}"
text=.cache/text/genesis-kjv.txt
[ -r "$text" ] || { echo "no $text: run scripts/fetch-text" >&2; exit 1; }
mkdir -p "$out"
suffix=""
if [ "${CHAPTER:-1}" != 1 ]; then
  suffix="-ch$CHAPTER"
  window="$(mktemp)"
  quant_tmp+=("$window")
  awk -v n="$CHAPTER" 'NF && ++p >= n' "$text" >"$window"
  text="$window"
fi
quant_start_kvkeepd
b1=$((tokens / 4))
b2=$((tokens / 8))
runs="full h2o:sinks=4,recent=$((b1 / 4))@$b1 h2o:sinks=4,recent=$((b2 / 4))@$b2"
runs="$runs streaming_llm:sinks=4@$b1 streaming_llm:sinks=4@$b2"
page_runs="full h2o_page:sinks=4,recent=$((b1 / 4))@$b1"
page_runs="$page_runs h2o_page:sinks=4,recent=$((b2 / 4))@$b2"
for name in ${DTYPES:-bf16 fp8 int8 int4 kivi}; do
  dtype="${name%-page}"
  these="$runs"
  [ "$dtype" = kivi ] || [ "$dtype" != "$name" ] && these="$page_runs"
  [ "$name" = bf16-all ] && these="$runs ${page_runs#full }"
  layout="$(quant_layout "$name")"
  echo "== $layout: $these" >&2
  "${KVKEEP_LM:-build/bin/kvkeep-lm}" perplexity --server="$KVKEEPD_ADDRESS" \
    --layout="$layout" --cache="${CACHE:-auto}" --text="$text" \
    --max_tokens="$tokens" --runs="$these" --json \
    >"$out/frontier-$name-$tokens$suffix.json"
done
python3 bench/lm/quant_frontier.py "$out"/frontier-*-"$tokens$suffix".json
