#!/usr/bin/env bash
# What keeping SmolLM2's KV cache in kvkeepd costs kvkeep-lm: decode tokens/s
# at a given context with the cache in kvkeepd (mapped host pool) against
# --local (the worker's own cache), in one run, each measured ROUNDS times
# (medians). Runs: local full; kvkeepd full (the store's cost alone);
# kvkeepd h2o at a quarter of the context (what eviction buys back).
#
#   bench/lm/store_cost.sh [CONTEXT=2048] [DECODE=64] [ROUNDS=3]
# Needs build/bin (./scripts/test or cmake --build build) and the model
# (scripts/fetch-model).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/lib.sh
context="${1:-2048}"
decode="${2:-64}"
rounds="${3:-3}"
text=/usr/share/common-licenses/GPL-3
log="$(mktemp)"
trap 'kill $KVKEEPD_PID 2>/dev/null || true; rm -f "$log"' EXIT
kvkeep_start_kvkeepd build/bin/kvkeepd "$log" --config=config/smollm2.json \
  --listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 --self_check=false

# Decode tokens/s of one run: the text's first CONTEXT tokens as a prompt,
# then DECODE tokens one at a time.
rate() {
  build/bin/kvkeep-lm perplexity --text="$text" --json \
    --max_tokens=$((context + decode)) --prompt_tokens="$context" "$@" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["decode_tokens_per_second"])'
}
median() { python3 -c 'import statistics,sys; print(statistics.median(map(float, sys.argv[1:])))' "$@"; }

local_r=() full_r=() h2o_r=()
for _ in $(seq "$rounds"); do
  local_r+=("$(rate --local)")
  full_r+=("$(rate --server="$KVKEEPD_ADDRESS" --policy=full)")
  h2o_r+=("$(rate --server="$KVKEEPD_ADDRESS" --policy=h2o \
    --params=sinks=4,recent=64 --budget=$((context / 4)))")
done
l="$(median "${local_r[@]}")"
f="$(median "${full_r[@]}")"
h="$(median "${h2o_r[@]}")"
echo "context $context, $decode decode steps, $rounds rounds (medians; all: local ${local_r[*]} / full ${full_r[*]} / h2o ${h2o_r[*]})"
python3 - "$l" "$f" "$h" "$context" <<'PY'
import sys
l, f, h, c = map(float, sys.argv[1:])
print(f"{'cache':<34}{'decode tokens/s':>16}{'of local':>10}")
print(f"{'local (worker keeps every token)':<34}{l:>16.1f}{1:>10.2f}")
print(f"{'kvkeepd full, mapped':<34}{f:>16.1f}{f / l:>10.2f}")
print(f"{'kvkeepd h2o @ ' + str(int(c) // 4) + ', mapped':<34}{h:>16.1f}{h / l:>10.2f}")
PY
