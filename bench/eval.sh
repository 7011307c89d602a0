#!/usr/bin/env bash
# Reproduces the README's Results: builds kvkeepd and kvkeep-eval, starts
# kvkeepd with bench/eval/kvkeepd.json (an f32 "eval" layout: 2 layers, 2 kv /
# 8 query heads, head_dim 64), runs every policy x budget x workload family
# (and the oracle) and the speed run, and writes under RESULTS (default
# bench/results): eval.md, eval.csv, speed.md, speed.csv and quality.png
# (gnuplot; Debian's gnuplot-nox is installed if missing).
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
build/bin/kvkeepd --config=bench/eval/kvkeepd.json --self_check=false >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true; rm -f "$log"' EXIT
address=""
for _ in $(seq 300); do
  address="$(sed -n 's/^kvkeepd: grpc listening on //p' "$log")"
  [ -n "$address" ] && break
  sleep 0.1
done
[ -n "$address" ] || { cat "$log" >&2; exit 1; }

sizes=(--prompt_tokens=1024 --decode_steps=256 --seed=1)
build/bin/kvkeep-eval --server="$address" --layout=eval "${sizes[@]}" \
  --out="$results" "$@"
build/bin/kvkeep-eval --server="$address" --layout=eval --speed \
  --prompt_tokens=1024 --speed_steps=128 --out="$results" "$@"
gnuplot -e "csv='$results/eval.csv'; png='$results/quality.png'" \
  bench/eval/plot.gp
echo "wrote $results/quality.png"
