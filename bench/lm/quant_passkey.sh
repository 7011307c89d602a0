#!/usr/bin/env bash
# The passkey half of issue 17's frontier: SmolLM2-135M answers the passkey
# tasks of the real-model grid (bench/eval-lm.sh's 1024-token tasks, seed 1,
# so its full-f32 and policy cells are a reference) with its KV cache in
# kvkeepd, for every KV layout of bench/lm/kvkeepd.json (bf16, fp8_e4m3,
# int8, int4; DTYPES picks some) x {full, streaming_llm, h2o, snapkv} at the
# grid's budgets and settings (BUDGETS, default a quarter and a half of each
# prompt; sinks 4, h2o's recent window half its budget, snapkv's window 64);
# kivi_int4, which takes full and h2o_page only, x {full, h2o_page}. One
# `kvkeep-lm answer` per layout; per (task, run) one JSON line (exact match,
# the true key's teacher-forced log p, the KV bytes the store really holds)
# in OUT/passkey-NAME-1024.jsonl (kept and resumed if it is there: a stopped
# run goes on), then the table on stdout, OUT/passkey-1024.csv and
# OUT/passkey-1024.png (bench/lm/quant_passkey.py).
#
#   bench/lm/quant_passkey.sh [DEPTHS=0.5] [OUT=bench/results/quant]
# RUNS="..." replaces the run list of every layout but kivi.
# DTYPES="bf16 fp8 int8 int4 kivi", BUDGETS="25% 50%", KEYS=20 (keys a
# depth), PARALLEL=10 (tasks a batch; each holds a full and six evicting
# sessions, and forks share the filler before the key). Needs build/bin
# (kvkeepd, kvkeep-lm), the model (scripts/fetch-model).
set -euo pipefail
cd "$(dirname "$0")/../.."
source bench/lm/quant_lib.sh
depths="${1:-0.5}"
out="${2:-bench/results/quant}"
mkdir -p "$out"
tasks="$out/tasks-passkey-1024.jsonl"
python3 bench/lm/make_tasks.py --seed=1 --tasks=passkey --lengths=1024 \
  --depths="$depths" --keys="${KEYS:-20}" --out="$tasks"
quant_start_kvkeepd
runs="full" page_runs="full"
for b in ${BUDGETS:-25% 50%}; do
  half="$(python3 -c "print(f'{float(\"${b%\%}\") / 2:g}%')")"
  runs="$runs streaming_llm:sinks=4@$b h2o:sinks=4,recent=$half@$b snapkv:window=64@$b"
  page_runs="$page_runs h2o_page:sinks=4,recent=$half@$b"
done
for name in ${DTYPES:-bf16 fp8 int8 int4 kivi}; do
  these="${RUNS:-$runs}"
  [ "$name" = kivi ] && these="$page_runs"
  echo "== $(date +%T) $(quant_layout "$name"): $these" >&2
  "${KVKEEP_LM:-build/bin/kvkeep-lm}" answer --server="$KVKEEPD_ADDRESS" \
    --layout="$(quant_layout "$name")" --cache="${CACHE:-auto}" \
    --tasks="$tasks" --positions=original --parallel="${PARALLEL:-10}" \
    --runs="$these" --resume --out="$out/passkey-$name-1024.jsonl"
done
ref=bench/results/lm/raw/answers-main.jsonl  # the main grid's (f32), if there
[ -r "$ref" ] || ref=""
python3 bench/lm/quant_passkey.py --csv="$out/passkey-1024.csv" \
  --png="$out/passkey-1024.png" ${ref:+--reference="$ref"} "$out"/passkey-*-1024.jsonl
