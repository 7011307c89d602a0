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
#   bench/eval-lm.sh [--quick] [--out=DIR] [--seed=N] [--no_press]
#
# --quick: a small grid (docs/lm-eval.md gives both grids and their times).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

quick=0 out=bench/results/lm seed=1 press=1
for arg in "$@"; do
  case "$arg" in
    --quick) quick=1 ;;
    --out=*) out="${arg#--out=}" ;;
    --seed=*) seed="${arg#--seed=}" ;;
    --no_press) press=0 ;;
    *) echo "usage: bench/eval-lm.sh [--quick] [--out=DIR] [--seed=N] [--no_press]" >&2
       exit 2 ;;
  esac
done

t0=$SECONDS
stage() { echo "== [$((SECONDS - t0)) s] $*" >&2; }
KVKEEP_PACKAGES+=(gnuplot-nox)
kvkeep_install_missing
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
if [ $quick = 1 ]; then
  ppl_tokens=2048
  ppl_budgets="5% 25% 256"
  ppl_policies="window streaming_llm:sinks=4 h2o:sinks=4,recent=H tova:sinks=4"
  ppl_cache_policies="window streaming_llm:sinks=4"
  task_flags=(--quick --conv_lengths=1024 --conv_keys=2 --lengths=1024 --keys=2)
  answer_budgets="25%"
else
  ppl_tokens=4096
  ppl_budgets="5% 10% 25% 50% 256 512 1024"
  ppl_policies="window streaming_llm:sinks=4 h2o:recent=H h2o:sinks=4,recent=H
    tova:sinks=0 tova:sinks=4 scissorhands:sinks=0 scissorhands:sinks=4
    h2o_page:recent=H h2o_page:sinks=4,recent=H"
  ppl_cache_policies="window streaming_llm:sinks=4 h2o:sinks=4,recent=H tova:sinks=4"
  task_flags=()
  answer_budgets="10% 25% 50%"
fi
answer_policies="window streaming_llm:sinks=4 h2o:sinks=4,recent=H tova:sinks=4
  scissorhands:sinks=4 h2o_page:sinks=4,recent=H snapkv:window=64"

# "POLICY[:params]" x budgets -> --runs; recent=H is half the budget.
runs() {
  local policies="$1" budgets="$2" r="full"
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

stage "perplexity: $ppl_tokens tokens of $(basename "$text"), positions=original"
lm perplexity --text="$text" --max_tokens=$ppl_tokens --positions=original \
  --json --runs="$(runs "$ppl_policies" "$ppl_budgets")" \
  >"$raw/perplexity-original.json"
stage "perplexity: positions=cache"
lm perplexity --text="$text" --max_tokens=$ppl_tokens --positions=cache \
  --json --runs="$(runs "$ppl_cache_policies" "$ppl_budgets")" \
  >"$raw/perplexity-cache.json"

stage "tasks (make_tasks.py --seed=$seed ${task_flags[*]})"
python3 bench/lm/make_tasks.py --seed="$seed" "${task_flags[@]}" \
  --out="$raw/tasks.jsonl"
stage "answers: $(wc -l <"$raw/tasks.jsonl") tasks, positions=original"
lm answer --tasks="$raw/tasks.jsonl" --positions=original --parallel=4 \
  --runs="$(runs "$answer_policies" "$answer_budgets")" \
  --out="$raw/answers-original.jsonl"

if [ $press = 1 ] && [ -f bench/lm/press_eval.py ] && [ -x scripts/kvpress-env ]; then
  stage "kvpress (bench/lm/press_eval.py)"
  py="$(scripts/kvpress-env | tail -n 1)"
  q=()
  [ $quick = 1 ] && q=(--quick)
  "$py" bench/lm/press_eval.py baseline --text="$text" --max_tokens=1024 \
    --kvkeep_lm=build/bin/kvkeep-lm --out="$out/press_baseline.csv"
  "$py" bench/lm/press_eval.py tasks --tasks="$raw/tasks.jsonl" "${q[@]}" \
    --out="$out/press_tasks.csv"
  "$py" bench/lm/press_eval.py perplexity --text="$text" \
    --max_tokens=$ppl_tokens --out="$out/press_perplexity.csv"
fi

stage "tables and plots"
python3 bench/lm/report.py --raw="$raw" --out="$out" --heatmap_budget=25%
stage "done: $out"
