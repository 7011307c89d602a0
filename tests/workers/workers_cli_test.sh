#!/usr/bin/env bash
# kvkeep-prefill and kvkeep-decode as separate processes against a real
# kvkeepd process, as a disaggregated deployment runs them: the prefill
# worker creates a session and prints its id; the decode worker (another
# process, the same workload flags) takes it over, streams the decode with
# --eval and closes it; the store ends with no session. Then the README's
# demo (kvkeep-eval --demo) on the same server: h2o keeps the needle that
# window and streaming_llm lose.
#
#   workers_cli_test.sh BIN_DIR CONFIG
set -euo pipefail
bin="$1"
config="$2"
source "$(dirname "$0")/../../scripts/lib.sh"
log="$(mktemp)"
trap 'kill -9 $KVKEEPD_PID 2>/dev/null || true; rm -f "$log"' EXIT
kvkeep_start_kvkeepd "$bin/kvkeepd" "$log" --config="$config" \
  --listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 --self_check=false ||
  { echo "FAIL: kvkeepd did not start"; exit 1; }
address="$KVKEEPD_ADDRESS"

fail() { echo "FAIL: $*"; exit 1; }
flags=(--server="$address" --workload=needle_repeated --prompt_tokens=256
       --decode_steps=48)

id="$("$bin/kvkeep-prefill" "${flags[@]}" --policy=h2o --budget=64 \
      --params=recent=32)"
# An id is the store's 16 hex digits, after its replica's name and a dot
# when it has one (docs/fleet.md).
[[ "$id" =~ ^([a-z0-9]([-a-z0-9]*[a-z0-9])?\.)?[0-9a-f]{16}$ ]] ||
  fail "prefill printed '$id', not a session id"
"$bin/kvkeep" --server="$address" sessions | grep -q "$id" ||
  fail "the session is not listed"

out="$("$bin/kvkeep-decode" "${flags[@]}" --session="$id" --eval)"
echo "$out"
grep -q "^steps 48," <<<"$out" || fail "decode did not run 48 steps"
grep -q "^attention loss" <<<"$out" || fail "no quality report"
grep -q "needle resident when asked: \([0-9]*\) of \1 " <<<"$out" ||
  fail "h2o lost the repeated needle"
sessions="$("$bin/kvkeep" --server="$address" sessions)"
grep -q "$id" <<<"$sessions" && fail "the decode worker did not close $id"

# A bad session id is a clear error, not a crash.
if err="$("$bin/kvkeep-decode" "${flags[@]}" --session=00000000000000ff 2>&1)"; then
  fail "decode of an unknown session succeeded"
fi
grep -q "NOT_FOUND" <<<"$err" || fail "unknown session: $err"

demo="$("$bin/kvkeep-eval" --demo "${flags[@]}" 2>/dev/null)"
echo "$demo"
grep -Eq "^h2o .* 100%$" <<<"$demo" || fail "demo: h2o lost the needle"
grep -Eq "^window .* 0%$" <<<"$demo" || fail "demo: window kept the needle"
grep -Eq "^streaming_llm .* 0%$" <<<"$demo" ||
  fail "demo: streaming_llm kept the needle"
echo PASS
