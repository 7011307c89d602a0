#!/usr/bin/env bash
# Reproduces the README's Results: builds kvkeepd and kvkeep-eval, starts
# kvkeepd with bench/eval/kvkeepd.json (an f32 "eval" layout: 2 layers, 2 kv /
# 8 query heads, head_dim 64), runs every policy x budget x workload family
# (and the oracle) and the speed run, and writes under RESULTS (default
# bench/results): eval.md, eval.csv, speed.md, speed.csv and quality.png
# (gnuplot; Debian's gnuplot-nox is installed if missing) and summary.md.
#
#   bench/eval.sh [RESULTS] [extra kvkeep-eval flags]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
KVKEEP_PACKAGES+=(gnuplot-nox)
kvkeep_install_missing
kvkeep_build build "kvkeepd kvkeep_eval"

results="${1:-bench/results}"
shift || true
mkdir -p "$results"
log="$(mktemp)"
trap 'kill $KVKEEPD_PID 2>/dev/null || true; rm -f "$log"' EXIT
kvkeep_start_kvkeepd build/bin/kvkeepd "$log" \
  --config=bench/eval/kvkeepd.json --self_check=false
address="$KVKEEPD_ADDRESS"

sizes=(--prompt_tokens=1024 --decode_steps=256 --seed=1)
build/bin/kvkeep-eval --server="$address" --layout=eval "${sizes[@]}" \
  --out="$results" "$@"
build/bin/kvkeep-eval --server="$address" --layout=eval --speed \
  --prompt_tokens=1024 --speed_steps=128 --out="$results" "$@"
gnuplot -e "csv='$results/eval.csv'; png='$results/quality.png'" \
  bench/eval/plot.gp
echo "wrote $results/quality.png"
