#!/usr/bin/env bash
# kvkeep-lm against a real kvkeepd process (config/smollm2.json: host pools
# shared, layouts for SmolLM2-135M), on the GPL-3 text every Debian machine
# has (/usr/share/common-licenses/GPL-3):
#  - full through kvkeep gives exactly the --local perplexity (the same
#    floats: the store returned the same bytes in the same order), reading
#    the mapped pool or a mirror, with either position scheme;
#  - below the text's length, window's perplexity rises and streaming_llm
#    (4 sinks) rises less; h2o and snapkv run within their budgets;
#  - kvkeepd killed mid-run: the worker exits 1 with a clear error.
# Prints "SKIPPED: ..." (ctest: skipped) when the model file is absent.
#
#   lm_worker_test.sh BIN_DIR CONFIG MODEL
source "$(dirname "$0")/lm_test_lib.sh"
lm_start_kvkeepd
text=/usr/share/common-licenses/GPL-3
lm() { "$bin/kvkeep-lm" "$1" --model="$model" --text="$text" --json "${@:2}"; }
# The perplexity of run $2 in JSON $1.
ppl() { field "$1" "$2" perplexity; }

tokens=320
for positions in original cache; do
  flags=(--max_tokens=$tokens --positions=$positions)
  local_ppl="$(ppl "$(lm perplexity --local "${flags[@]}")" full)"
  for cache in mapped mirror; do
    out="$(lm perplexity --server="$KVKEEPD_ADDRESS" --cache=$cache "${flags[@]}")"
    got="$(ppl "$out" full)"
    echo "positions=$positions cache=$cache: full $got, local $local_ppl"
    [ "$got" = "$local_ppl" ] ||
      fail "full through kvkeep ($cache, $positions) gave $got, local $local_ppl"
  done
done

out="$(lm perplexity --server="$KVKEEPD_ADDRESS" --max_tokens=$tokens \
  --runs="full window@64 streaming_llm:sinks=4@64 h2o:sinks=4,recent=16@64")"
echo "$out"
full="$(ppl "$out" full)"
window="$(ppl "$out" window@64)"
sinks="$(ppl "$out" streaming_llm:sinks=4@64)"
less "$full" "$window" || fail "window@64 ($window) is not above full ($full)"
less "$sinks" "$window" ||
  fail "streaming_llm@64 ($sinks) is not below window@64 ($window)"
for run in window@64 streaming_llm:sinks=4@64 h2o:sinks=4,recent=16@64; do
  resident="$(field "$out" "$run" resident_tokens_per_layer)"
  less "$resident" 64.5 || fail "$run holds $resident tokens per layer"
done

out="$(lm perplexity --server="$KVKEEPD_ADDRESS" --max_tokens=$tokens \
  --prompt_tokens=192 --runs="full snapkv:window=32@96")"
echo "$out"
resident="$(field "$out" snapkv:window=32@96 resident_tokens_per_layer)"
# 96 kept at the prompt's end, then every later token.
[ "$resident" = "$((96 + tokens - 192)).0" ] ||
  fail "snapkv holds $resident tokens per layer, not $((96 + tokens - 192))"

# Bad input: a clear error, exit 1.
if err="$(lm perplexity --server="$KVKEEPD_ADDRESS" --max_tokens=32 \
  --policy=h2o --params=nonsense=1 --budget=16 2>&1)"; then
  fail "an unknown policy parameter was accepted"
fi
grep -q "INVALID_ARGUMENT" <<<"$err" || fail "unknown parameter: $err"

# kvkeepd dies mid-run.
lm perplexity --server="$KVKEEPD_ADDRESS" --max_tokens=4000 \
  >/dev/null 2>"$tmp/lm.log" &
lm_pid=$!
sleep 8
kill -0 $lm_pid 2>/dev/null || fail "kvkeep-lm ended before kvkeepd was killed"
kill -9 "$KVKEEPD_PID"
status=0
wait $lm_pid || status=$?
cat "$tmp/lm.log"
[ "$status" = 1 ] || fail "kvkeep-lm exited $status after kvkeepd died"
grep -q "^kvkeep-lm: UNAVAILABLE: .*at token [0-9]*" "$tmp/lm.log" ||
  fail "no clear error after kvkeepd died"
echo PASS
