#!/usr/bin/env bash
# kvkeep-lm answer against a real kvkeepd process, on passkey tasks from
# bench/lm/make_tasks.py (about 256 tokens, the key at 30% or 70%):
#  - full's teacher-forced answer log-probability is what perplexity --local
#    gives for the same tokens (the prompt's and prompt + answer's summed
#    log-likelihoods differ by exactly that), within 2e-3;
#  - full's greedy answer is generate's (--local, the same prompt);
#  - full finds every key; window@48 keeps 48 tokens per layer, the key is
#    gone and it finds none, its answer log-probability far below full's;
#    streaming_llm:sinks=4@48 holds 48 tokens too; each line says how much of
#    the key the cache held when the question came (all of both copies in
#    every layer for full, nothing for window@48);
#  - a budget given as a share resolves per task; a task file with a broken
#    line is a clear error naming the line;
#  - lanes of a run whose prompts begin alike stream the common part once
#    and fork there (--share_prefix, on by default): every answer is the one
#    a run without forks gives (the same pairs, greedy tokens and resident
#    bytes; log-probabilities within 1e-3), the second task of each batch
#    took a fork of the first's, and no forked session is left open;
#  - on a kvkeepd with a 1 s lease the same answers come back, no session
#    is left, and only forking lanes' unused sessions idle out (finished
#    lanes close theirs at once).
# Prints "SKIPPED: ..." (ctest: skipped) when the model file is absent.
#
#   lm_answer_test.sh BIN_DIR CONFIG MODEL
source "$(dirname "$0")/lm_test_lib.sh"
lm_start_kvkeepd

python3 "$here/../../bench/lm/make_tasks.py" --tasks=passkey --lengths=256 \
  --depths=0.3,0.7 --keys=2 --seed=5 --out="$tmp/tasks.jsonl"
runs="full window@48 streaming_llm:sinks=4@48 h2o:sinks=4,recent=16@25%"
"$bin/kvkeep-lm" answer --model="$model" --server="$KVKEEPD_ADDRESS" \
  --tasks="$tmp/tasks.jsonl" --runs="$runs" --parallel=2 \
  --out="$tmp/answers.jsonl"
[ "$(wc -l <"$tmp/answers.jsonl")" = 16 ] ||
  fail "expected 16 answer lines (4 tasks x 4 runs)"

python3 - "$tmp/answers.jsonl" <<'EOF' || fail "answers"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
by = {}
for r in rows:
    by.setdefault(r["run"], []).append(r)
    print(r["id"], r["run"], repr(r["generated"]), r["exact"],
          round(r["answer_logprob"], 3), r["resident_tokens_per_layer"])
assert all(r["exact"] for r in by["full"]), "full missed a key"
assert not any(r["exact"] for r in by["window@48"]), "window@48 found a key"
for f, w in zip(by["full"], by["window@48"]):
    assert w["answer_logprob"] < f["answer_logprob"] - 5, (f, w)
for run in ("window@48", "streaming_llm:sinks=4@48"):
    assert all(r["resident_tokens_per_layer"] <= 48 for r in by[run]), run
for r in by["h2o:sinks=4,recent=16@25%"]:
    assert r["budget_tokens"] == r["prompt_tokens"] // 4, r
    assert r["resident_tokens_per_layer"] <= r["budget_tokens"], r
assert all(r["answer_token_count"] == 6 for r in rows)  # " " and 5 digits
# The key in the cache when the question comes: both copies ("The pass key
# is K. Remember it. K is the pass key.") in every layer of full, in no
# layer of window@48 (the last 48 tokens are filler and the question).
assert all(r["answer_copies"] == 2 for r in rows), "the key's two copies"
for r in by["full"]:
    assert r["answer_layers_whole"] == 30 and r["answer_token_share"] == 1, r
for r in by["window@48"]:
    assert r["answer_layers_whole"] == 0 and r["answer_token_share"] == 0, r
for r in rows:
    assert 0 <= r["answer_token_share"] <= 1 and 0 <= r["answer_layers_whole"] <= 30
EOF

# Shared prefixes: the same tasks with every lane streaming its whole
# prompt give the same answers; the forks were real and are all closed.
"$bin/kvkeep-lm" answer --model="$model" --server="$KVKEEPD_ADDRESS" \
  --tasks="$tmp/tasks.jsonl" --runs="$runs" --parallel=2 --share_prefix=0 \
  --out="$tmp/unshared.jsonl"
python3 - "$tmp/answers.jsonl" "$tmp/unshared.jsonl" <<'EOF' || fail "forks"
import json, sys
shared = [json.loads(l) for l in open(sys.argv[1])]
alone = [json.loads(l) for l in open(sys.argv[2])]
assert len(shared) == len(alone) == 16
forked = 0
for s, a in zip(shared, alone):
    assert (s["id"], s["run"]) == (a["id"], a["run"]), (s, a)
    assert a["shared_prefix_tokens"] == 0, a
    if s["shared_prefix_tokens"]:
        forked += 1
        assert 64 <= s["shared_prefix_tokens"] < s["prompt_tokens"], s
    print(s["id"], s["run"], "shared", s["shared_prefix_tokens"],
          "log p", round(s["answer_logprob"], 5), round(a["answer_logprob"], 5))
    assert abs(s.pop("answer_logprob") - a.pop("answer_logprob")) < 1e-3
    s.pop("shared_prefix_tokens"), a.pop("shared_prefix_tokens")
    assert s == a, (s, a)
# Batches of 2 tasks, the key at the same depth: the second task of each
# batch forks the first's lane of every run (4 runs x 2 batches).
assert forked == 8, forked
print("shared prefixes: 8 of 16 lanes forked, every answer as without")
EOF
open="$("$bin/kvkeep" --server="$KVKEEPD_ADDRESS" --json sessions)"
python3 -c 'import json, sys; sys.exit(len(json.loads(sys.argv[1]).get("sessions", [])) != 0)' \
  "$open" || fail "sessions left open after the answers: $open"

# The teacher-forced log-probability, the long way: perplexity over the
# prompt and over prompt + " " + answer (digits tokenize alike alone or
# after the prompt), --local, token by token.
python3 - "$tmp" <<'EOF'
import json, sys
tmp = sys.argv[1]
t = json.loads(open(f"{tmp}/tasks.jsonl").readline())
open(f"{tmp}/prompt.txt", "w").write(t["context"] + t["question"])
open(f"{tmp}/full.txt", "w").write(t["context"] + t["question"] + " " + t["answer"])
EOF
nll() {
  "$bin/kvkeep-lm" perplexity --local --model="$model" --text="$1" --json |
    python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["nll_sum"])'
}
python3 - "$(nll "$tmp/prompt.txt")" "$(nll "$tmp/full.txt")" \
  "$tmp/answers.jsonl" <<'EOF' || fail "teacher-forced log-probability"
import json, sys
prompt_nll, full_nll = float(sys.argv[1]), float(sys.argv[2])
row = json.loads(open(sys.argv[3]).readline())
assert row["run"] == "full"
expected = prompt_nll - full_nll
print(f"answer log-probability {row['answer_logprob']:.5f}, "
      f"from perplexity {expected:.5f}")
assert abs(row["answer_logprob"] - expected) < 2e-3
EOF

# Greedy: generate's continuation of the same prompt (8 tokens).
generated="$("$bin/kvkeep-lm" generate --local --model="$model" \
  --prompt_file="$tmp/prompt.txt" --max_new_tokens=8 2>/dev/null)"
python3 - "$generated" "$tmp/answers.jsonl" <<'EOF' || fail "greedy answer"
import json, sys
row = json.loads(open(sys.argv[2]).readline())
print(f"generate: {sys.argv[1]!r}, answer: {row['generated']!r}")
assert sys.argv[1].rstrip("\n") == row["generated"]
EOF

# --resume: a grid stopped part way (10 of the 16 lines, the last cut short)
# goes on with only the missing (task, run) pairs; the lines it adds are the
# ones a whole run wrote (the same answers and sessions).
head -n 9 "$tmp/answers.jsonl" >"$tmp/resumed.jsonl"
sed -n 10p "$tmp/answers.jsonl" | head -c 40 >>"$tmp/resumed.jsonl"
echo >>"$tmp/resumed.jsonl"
"$bin/kvkeep-lm" answer --model="$model" --server="$KVKEEPD_ADDRESS" \
  --tasks="$tmp/tasks.jsonl" --runs="$runs" --parallel=2 --resume \
  --out="$tmp/resumed.jsonl" 2>"$tmp/resume.log"
python3 - "$tmp/answers.jsonl" "$tmp/resumed.jsonl" <<'EOF' || fail "--resume"
import json, sys
whole = [json.loads(l) for l in open(sys.argv[1])]
lines = open(sys.argv[2]).read().splitlines()
resumed = [json.loads(l) for l in lines[:9] + lines[10:]]
key = lambda r: (r["id"], r["run"])
assert len(resumed) == 16, len(resumed)
assert sorted(map(key, resumed)) == sorted(map(key, whole)), "pairs differ"
for r in resumed:  # batches of other sizes may round the last bits apart
    w = next(x for x in whole if key(x) == key(r))
    assert abs(r.pop("answer_logprob") - w.pop("answer_logprob")) < 1e-3, r
    r.pop("shared_prefix_tokens"), w.pop("shared_prefix_tokens")  # batches
    assert r == w, (r, w)
print("resume: 7 (task, run) pairs run again, every line as a whole run's")
EOF
grep -q "2 tasks, 7 answers" "$tmp/resume.log" ||
  fail "resume ran other than the 7 missing pairs: $(cat "$tmp/resume.log")"

# Short leases (full and h2o): on a kvkeepd whose sessions expire after
# 1 s idle, a lane that forks another's prefix leaves the session it was
# opened with unused while the donor streams (70-180 rounds of the model,
# seconds on 2 cores), and lanes done early wait for the rest of their
# batch. The run still ends well with the same answers: kvkeep-lm closes a
# lane's unused session when it forks and a lane's session when it is
# done, and an open Decode stream keeps an active session's lease. (On a
# machine fast enough to feed the prefix within the lease nothing expires;
# the line printed says.)
kill "$KVKEEPD_PID"
wait "$KVKEEPD_PID" 2>/dev/null || true
kvkeep_start_kvkeepd "$bin/kvkeepd" "$tmp/short.log" --config="$config" \
  --listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 --self_check=false \
  --session_idle_timeout_seconds=1 || fail "kvkeepd did not start"
"$bin/kvkeep-lm" answer --model="$model" --server="$KVKEEPD_ADDRESS" \
  --tasks="$tmp/tasks.jsonl" --runs="full h2o:sinks=4,recent=16@25%" \
  --parallel=2 --out="$tmp/short.jsonl" || fail "answers under a 1 s lease"
metrics="$(sed -n 's/^kvkeepd: metrics on //p' "$tmp/short.log")"
python3 - "$tmp/answers.jsonl" "$tmp/short.jsonl" "$metrics" <<'EOF' ||
import json, re, sys, urllib.request
short = [json.loads(l) for l in open(sys.argv[2])]
whole = [json.loads(l) for l in open(sys.argv[1])]
whole = [w for w in whole if w["run"] in ("full", "h2o:sinks=4,recent=16@25%")]
assert len(short) == len(whole) == 8, len(short)
forked = sum(1 for s in short if s["shared_prefix_tokens"])
for s, w in zip(short, whole):
    assert (s["id"], s["run"]) == (w["id"], w["run"]), (s, w)
    assert abs(s.pop("answer_logprob") - w.pop("answer_logprob")) < 1e-3, s
    assert s == w, (s, w)
text = urllib.request.urlopen(sys.argv[3], timeout=10).read().decode()
value = lambda name: float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))
assert value("kvkeep_sessions") == 0, "sessions left open"
# Only a forking lane's own session may idle out: finished lanes close
# theirs, active ones keep a Decode stream open.
expired = value("kvkeep_sessions_expired_total")
assert expired <= forked, f"{expired:g} sessions expired, {forked} lanes forked"
print(f"1 s lease: every answer as before; {expired:g} sessions expired "
      f"unused, of {forked} lanes that forked")
EOF
  fail "answers under a 1 s lease differ, or sessions were left"

# A broken task file: a clear error naming the line.
printf '{"id": "a", "context": "x", "question": "y", "answer": "z"}\nnot json\n' \
  >"$tmp/bad.jsonl"
if err="$("$bin/kvkeep-lm" answer --model="$model" \
  --server="$KVKEEPD_ADDRESS" --tasks="$tmp/bad.jsonl" 2>&1)"; then
  fail "a broken task file was accepted"
fi
grep -q "INVALID_ARGUMENT: .*bad.jsonl:2:" <<<"$err" || fail "bad line: $err"
echo PASS
