# Sourced by the kvkeep-lm shell tests, which run as
#   lm_*_test.sh BIN_DIR CONFIG MODEL
# Sets bin, config, model, here (tests/lm) and tmp (a scratch folder removed
# on exit, with kvkeepd killed); prints "SKIPPED: ..." and exits 77 (ctest:
# skipped) when the model file is absent; defines lm_start_kvkeepd (kvkeepd
# on CONFIG at free loopback ports, its log in $tmp/kvkeepd.log) and the
# checks fail, field, less and within.
set -euo pipefail
bin="$1"
config="$2"
model="$3"
if [ ! -r "$model" ]; then
  echo "SKIPPED: model absent at $model: run scripts/fetch-model"
  exit 77
fi
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../../scripts/lib.sh"
tmp="$(mktemp -d)"
trap 'kill -9 $KVKEEPD_PID 2>/dev/null || true; rm -rf "$tmp"' EXIT

fail() { echo "FAIL: $*"; exit 1; }
lm_start_kvkeepd() {
  kvkeep_start_kvkeepd "$bin/kvkeepd" "$tmp/kvkeepd.log" --config="$config" \
    --listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 --self_check=false ||
    fail "kvkeepd did not start"
}
# field JSON RUN NAME: NAME of run RUN in kvkeep-lm's --json output JSON
# (Python's repr: a float to its last digit).
field() { python3 -c 'import json,sys; r=[x for x in json.loads(sys.argv[1]) if x["run"]==sys.argv[2]]; print(repr(r[0][sys.argv[3]]))' "$1" "$2" "$3"; }
# less A B: A < B. within A B T: |A - B| <= T * B.
less() { python3 -c 'import sys; sys.exit(0 if float(sys.argv[1]) < float(sys.argv[2]) else 1)' "$1" "$2"; }
within() { python3 -c 'import sys; a,b,t=map(float,sys.argv[1:]); sys.exit(0 if abs(a-b) <= t*b else 1)' "$1" "$2" "$3"; }
