#!/usr/bin/env bash
# The kvpress side of the real-model evaluation (issue 16, docs/kvpress.md),
# one command; bench/eval-lm.sh calls it when it exists.
#
#   bench/lm/press_run.sh [--quick] [--tasks=FILE] [--text=FILE] [--max_tokens=N]
#
# Makes the venv (scripts/kvpress-env), fetches the model (scripts/fetch-model)
# and writes into bench/results/lm/:
#   press_baseline.csv     full-cache perplexity, transformers vs kvkeep-lm --local
#                          (when build/bin/kvkeep-lm exists; fails if they differ)
#   press_tasks[_quick].csv  + .md   kvpress's pipeline on the tasks
#   press_perplexity[_quick].csv     kvpress's DecodingPress on the text
# --tasks: a make_tasks.py file (default: made here with the same --quick).
set -euo pipefail
cd "$(dirname "$0")/../.."

quick="" tasks="" text=/usr/share/common-licenses/GPL-3 max_tokens=1024
for arg in "$@"; do
  case "$arg" in
    --quick) quick=--quick ;;
    --tasks=*) tasks="${arg#--tasks=}" ;;
    --text=*) text="${arg#--text=}" ;;
    --max_tokens=*) max_tokens="${arg#--max_tokens=}" ;;
    *) echo "press_run.sh: unknown argument $arg" >&2; exit 2 ;;
  esac
done
suffix=${quick:+_quick}
out=bench/results/lm
mkdir -p "$out"

py="$(scripts/kvpress-env | tail -n 1)"
export KVKEEP_MODEL="${KVKEEP_MODEL:-$(scripts/fetch-model | tail -n 1)}"
if [ -z "$tasks" ]; then
  tasks="$out/tasks$suffix.jsonl"
  python3 bench/lm/make_tasks.py $quick --out="$tasks"
fi

if [ -x build/bin/kvkeep-lm ]; then
  rm -f "$out/press_baseline.csv"
  OPENBLAS_NUM_THREADS=2 "$py" bench/lm/press_eval.py baseline --text="$text" \
    --max_tokens="$max_tokens" --kvkeep_lm=build/bin/kvkeep-lm \
    --out="$out/press_baseline.csv"
else
  echo "press_run.sh: no build/bin/kvkeep-lm: the baseline has the transformers side only" >&2
  "$py" bench/lm/press_eval.py baseline --text="$text" --max_tokens="$max_tokens" \
    --out="$out/press_baseline.csv"
fi
"$py" bench/lm/press_eval.py tasks --tasks="$tasks" $quick \
  --out="$out/press_tasks$suffix.csv"
"$py" bench/lm/press_eval.py summary --csv="$out/press_tasks$suffix.csv" \
  --out="$out/press_tasks$suffix.md" >/dev/null
if [ -n "$quick" ]; then
  bases=streaming_llm,knorm
else
  bases=streaming_llm,knorm,tova,expected_attention
fi
"$py" bench/lm/press_eval.py perplexity --text="$text" --max_tokens="$max_tokens" \
  --presses="$bases" --budgets=256 --out="$out/press_perplexity$suffix.csv"
