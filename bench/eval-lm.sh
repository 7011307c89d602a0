#!/usr/bin/env bash
# The real-model evaluation (issue 16; docs/lm-eval.md): SmolLM2-135M on the
# CPU with its KV cache in kvkeepd, every policy at several budgets, on
#   - perplexity: Genesis (KJV, scripts/fetch-text), token by token, both
#     position schemes;
#   - passkey retrieval and conversation recall (bench/lm/make_tasks.py),
#     through `kvkeep-lm answer`;
#   - and, where bench/lm/press_eval.py is there, kvpress on the same model
#     and tasks (its own venv, scripts/kvpress-env).
# Builds kvkeepd and kvkeep-lm, fetches the model and the text, starts
# kvkeepd (bench/lm/kvkeepd.json), and writes under OUT (default
# bench/results/lm): the raw outputs (raw/), CSVs, Markdown tables
# (*.md) and PNG plots (gnuplot; Debian's gnuplot-nox is installed if
# missing). Progress lines on a terminal.
#
#   bench/eval-lm.sh [--quick] [--out=DIR] [--seed=N] [--no_press] [--resume]
#
# --quick: a small grid (docs/lm-eval.md gives both grids and their times).
# --resume: keep what OUT already holds (each stage's finished output, and
#   every (task, run) line of the answers) and run only the rest: the full
#   grid takes hours, and a stopped run goes on where it stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

quick=0 out=bench/results/lm seed=1 press=1 resume=0
for arg in "$@"; do
  case "$arg" in
    --quick) quick=1 ;;
    --out=*) out="${arg#--out=}" ;;
    --seed=*) seed="${arg#--seed=}" ;;
    --no_press) press=0 ;;
    --resume) resume=1 ;;
    *) echo "usage: bench/eval-lm.sh [--quick] [--out=DIR] [--seed=N] [--no_press] [--resume]" >&2
       exit 2 ;;
  esac
done

t0=$SECONDS
stage() { echo "== [$((SECONDS - t0)) s] $*" >&2; }
# finished FILE: whether --resume keeps FILE (a stage's finished output: every
# stage writes FILE.part and renames it when it ends).
finished() { [ $resume = 1 ] && [ -s "$1" ]; }
# Python's progress bars (tqdm) redraw in place: on a terminal only.
[ -t 2 ] || export TQDM_DISABLE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
KVKEEP_PACKAGES+=(gnuplot-nox)
kvkeep_install_missing
kvkeep_openblas_env  # the model's matrix products (scripts/lib.sh)
# kvpress's torch runs OpenMP, whose threads spin at every barrier: on a
# machine shared with anything else a spinning thread waits on a
# descheduled one (2.7x slower rows on 2026-12-02). kvkeep-lm has no OpenMP.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
stage "build kvkeepd, kvkeep-lm"
kvkeep_build build "kvkeepd kvkeep_lm"
model="$(scripts/fetch-model | tail -n 1)"
text="$(scripts/fetch-text | tail -n 1)"

raw="$out/raw"
mkdir -p "$raw"
log="$(mktemp)"
trap 'kill $KVKEEPD_PID 2>/dev/null || true; rm -f "$log"' EXIT
kvkeep_start_kvkeepd build/bin/kvkeepd "$log" \
  --config=bench/lm/kvkeepd.json --self_check=false
lm() { build/bin/kvkeep-lm "$1" --model="$model" --server="$KVKEEPD_ADDRESS" "${@:2}"; }

# --- the grids ---------------------------------------------------------------
# Perplexity: budgets as shares of the text and fixed sizes; every policy
# with and without 4 sinks (streaming_llm is window + sinks); h2o and
# h2o_page keep half their budget as a recent window (H2O's split).
# Answers: passkey and conversation tasks (make_tasks.py) with every policy
# at one budget (the heat maps'), then a budget sweep on the shortest
# passkey tasks.
if [ $quick = 1 ]; then
  ppl_tokens=2048
  ppl_budgets="5% 25% 256"
  ppl_policies="window streaming_llm:sinks=4 h2o:sinks=4,recent=H tova:sinks=4"
  ppl_cache_policies="window streaming_llm:sinks=4"
  ppl_cache_budgets="$ppl_budgets"
  task_flags=(--quick --lengths=1024 --keys=2 --conv_lengths=1024 --conv_keys=2)
  sweep_flags=()
else
  ppl_tokens=4096
  ppl_budgets="5% 10% 25% 50% 256 512 1024"
  ppl_policies="window streaming_llm:sinks=4 h2o:recent=H h2o:sinks=4,recent=H
    tova:sinks=0 tova:sinks=4 scissorhands:sinks=0 scissorhands:sinks=4
    h2o_page:recent=H h2o_page:sinks=4,recent=H"
  ppl_cache_policies="window streaming_llm:sinks=4 h2o:sinks=4,recent=H tova:sinks=4"
  # Re-indexed positions at the shares only: 1024 tokens is 25% of the
  # 4096 again, and 256/512 sit between shares the table already has.
  ppl_cache_budgets="5% 10% 25% 50%"
  # Five depths at 1024 tokens, three (the ends and the middle) at 2048 and
  # 4096, 20 keys each (10 at 4096, the keys kvpress runs there too): what
  # the grid's time allows (docs/lm-eval.md).
  task_flags=(--depths=0.1,0.3,0.5,0.7,0.9 --conv_lengths=1024,2048 --conv_keys=10)
  long_depths=(--depths=0.1,0.5,0.9)
  sweep_flags=(--tasks=passkey --lengths=1024 --depths=0.1,0.5,0.9)
fi
answer_budget="25%" press_kept=0.25 sweep_budgets="10% 50%"
answer_policies="window streaming_llm:sinks=4 h2o:sinks=4,recent=H tova:sinks=4
  scissorhands:sinks=4 h2o_page:sinks=4,recent=H snapkv:window=64"

# "POLICY[:params]" x budgets -> --runs; recent=H is half the budget.
runs() {
  local policies="$1" budgets="$2" r="${3-full}"
  for b in $budgets; do
    local half
    case "$b" in
      *%) half="$(python3 -c "print(f'{float(\"${b%\%}\") / 2:g}%')")" ;;
      *) half=$((b / 2)) ;;
    esac
    for p in $policies; do r="$r ${p//recent=H/recent=$half}@$b"; done
  done
  echo "$r"
}

# perplexity POSITIONS POLICIES BUDGETS: one batch per budget (full with the
# first), each kept by --resume once done, so a stopped grid loses at most
# one batch; raw/perplexity-POSITIONS.json gathers the batches done so far.
perplexity() {
  local parts="$raw/perplexity-parts" done_parts=() first=1
  mkdir -p "$parts"
  for b in $3; do
    local file="$parts/$1-${b/\%/pct}.json" r
    if [ $first = 1 ]; then r="$(runs "$2" "$b")"; else r="$(runs "$2" "$b" "")"; fi
    first=0
    if finished "$file"; then
      stage "perplexity, positions=$1, budget $b: kept"
    else
      stage "perplexity: $ppl_tokens tokens of $(basename "$text"), positions=$1, budget $b"
      lm perplexity --text="$text" --max_tokens=$ppl_tokens --positions="$1" \
        --json --runs="$r" >"$file.part"
      mv "$file.part" "$file"
    fi
    done_parts+=("$file")
    python3 -c 'import json, sys
print(json.dumps([r for f in sys.argv[1:] for r in json.load(open(f))], indent=1))' \
      "${done_parts[@]}" >"$raw/perplexity-$1.json"
  done
}
[ $resume = 1 ] || rm -rf "$raw/perplexity-parts" "$raw"/perplexity-*.json
perplexity original "$ppl_policies" "$ppl_budgets"
perplexity cache "$ppl_cache_policies" "$ppl_cache_budgets"

# Answers, one context length at a time (a stopped full grid leaves whole
# lengths done): kvkeep's policies, then kvpress's presses on the same tasks.
# Each (task, run) is one line of answers-NAME.jsonl and each (task, press)
# one row of press_tasks.csv; without --resume they start empty.
[ $resume = 1 ] || rm -f "$raw"/answers-*.jsonl "$out"/press_tasks.csv \
  "$out"/press_baseline.csv "$out"/press_perplexity.csv \
  "$out"/press_perplexity_ordered.csv
press_ok=0
if [ $press = 1 ] && [ -f bench/lm/press_eval.py ] && [ -x scripts/kvpress-env ]; then
  press_ok=1
  py="$(scripts/kvpress-env | tail -n 1)"
  if ! finished "$out/press_baseline.csv"; then
    stage "kvpress: the full-cache baseline against kvkeep-lm --local"
    "$py" bench/lm/press_eval.py baseline --text="$text" --max_tokens=1024 \
      --kvkeep_lm=build/bin/kvkeep-lm --out="$out/press_baseline.csv"
  fi
fi

# answers NAME RUNS MAKE_TASKS_FLAGS...: the tasks (raw/tasks-NAME.jsonl)
# and every missing (task, run) through kvkeep. PARALLEL tasks a batch
# (default 4): more lanes share each pass over the weights and each shared
# prefix, and need more of kvkeepd's pool.
answers() {
  local name="$1" runs="$2" tasks="$raw/tasks-$1.jsonl"
  shift 2
  python3 bench/lm/make_tasks.py --seed="$seed" "$@" --out="$tasks" 2>/dev/null
  stage "answers ($name): $(wc -l <"$tasks") tasks x $(wc -w <<<"$runs") runs"
  lm answer --tasks="$tasks" --positions=original --parallel="${PARALLEL:-4}" --resume \
    --runs="$runs" --out="$raw/answers-${name%%-*}.jsonl"
}
# press NAME: kvpress on the same tasks (KEPT: its kept fractions;
# PRESSES: which, default all; KEYS: the first KEYS passkey keys of each
# cell, default all).
press() {
  [ $press_ok = 1 ] || return 0
  local kept="${KEPT:-$press_kept}" q=()
  stage "kvpress ($1): its pipeline on the same tasks, $kept kept"
  [ $quick = 1 ] && q=(--quick)
  "$py" bench/lm/press_eval.py tasks --tasks="$raw/tasks-$1.jsonl" \
    --kept="$kept" --presses="${PRESSES:-}" --max_keys="${KEYS:-0}" \
    --resume "${q[@]}" --out="$out/press_tasks.csv"
}
main_runs="$(runs "$answer_policies" "$answer_budget")"
if [ $quick = 1 ]; then
  answers main "$main_runs" "${task_flags[@]}"
  press main
else
  # kvkeep's lengths first (the heat maps need them all), then the budget
  # sweep, then kvpress on the same tasks, the shortest first: a grid
  # stopped part way leaves whole stages done.
  PARALLEL=8 answers main-1024 "$main_runs" "${task_flags[@]}" --lengths=1024 \
    --conv_lengths=1024
  press main-1024
  PARALLEL=8 answers main-2048 "$main_runs" "${task_flags[@]}" "${long_depths[@]}" \
    --lengths=2048 --conv_lengths=2048
  answers main-4096 "$main_runs" "${task_flags[@]}" "${long_depths[@]}" \
    --lengths=4096 --tasks=passkey --keys=10
  PARALLEL=8 answers budgets "$(runs "$answer_policies" "$sweep_budgets" "")" \
    "${sweep_flags[@]}"
  # kvpress past 1024 tokens: the methods both sides have and its own
  # strongest, on the first 10 keys of each cell (a row at 4096 tokens is
  # about half a minute of the 2-core machine).
  long_presses=full,streaming_llm,snapkv,tova,observed_attention,pyramidkv,expected_attention
  PRESSES=$long_presses KEYS=10 press main-2048
  PRESSES=$long_presses KEYS=10 press main-4096
  PRESSES=${long_presses#full,} KEYS=10 KEPT=0.1,0.5 press budgets
fi

if [ $press_ok = 1 ]; then
  "$py" bench/lm/press_eval.py summary --csv="$out/press_tasks.csv" \
    --out="$out/press_tasks.md" >/dev/null
  if [ $quick = 0 ] && ! finished "$out/press_perplexity.csv"; then
    stage "kvpress: DecodingPress on $ppl_tokens tokens"
    # The methods both sides have, and kvpress's KNorm; full is kvkeep's
    # (the baseline above shows the two agree). The full grid only: slow.
    "$py" bench/lm/press_eval.py perplexity --text="$text" \
      --presses=streaming_llm,tova,knorm --no_full --budgets=256 \
      --max_tokens=$ppl_tokens --out="$out/press_perplexity.csv.part"
    mv "$out/press_perplexity.csv.part" "$out/press_perplexity.csv"
  fi
  if [ $quick = 0 ] && ! finished "$out/press_perplexity_ordered.csv"; then
    stage "kvpress: DecodingPress(StreamingLLM) with its slots kept in order"
    # kvpress as shipped reorders the slots StreamingLLM keeps by index
    # (NVIDIA/kvpress#173, docs/kvpress.md); --keep_order is the press as
    # its paper means it, the one to set beside kvkeep's streaming_llm.
    "$py" bench/lm/press_eval.py perplexity --text="$text" --keep_order \
      --presses=streaming_llm --no_full --budgets=256 \
      --max_tokens=$ppl_tokens --out="$out/press_perplexity_ordered.csv.part"
    mv "$out/press_perplexity_ordered.csv.part" \
      "$out/press_perplexity_ordered.csv"
  fi
fi

stage "tables and plots"
python3 bench/lm/report.py --raw="$raw" --out="$out" --heatmap_budget="$answer_budget"
stage "done: $out"
