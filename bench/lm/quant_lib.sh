# Shared by bench/lm/quant_frontier.sh and quant_passkey.sh (sourced, not
# executed; from the checkout's root): kvkeepd on bench/lm/kvkeepd.json and
# the names of its quantised layouts.

source scripts/lib.sh
kvkeep_openblas_env  # the kernels bench/eval-lm.sh uses (docs/quantization.md)

# Temporary files (quant_tmp+=(FILE)) go, and kvkeepd stops, at exit.
quant_tmp=()
KVKEEPD_PID=""
trap '[ -z "$KVKEEPD_PID" ] || kill "$KVKEEPD_PID" 2>/dev/null || true
  rm -f "${quant_tmp[@]}"' EXIT

# quant_start_kvkeepd: kvkeepd (KVKEEPD=PATH: another binary) in the
# background; sets KVKEEPD_ADDRESS.
quant_start_kvkeepd() {
  local quant_log
  quant_log="$(mktemp)"
  quant_tmp+=("$quant_log")
  kvkeep_start_kvkeepd "${KVKEEPD:-build/bin/kvkeepd}" "$quant_log" \
    --config=bench/lm/kvkeepd.json --listen=127.0.0.1:0 \
    --metrics_listen=127.0.0.1:0 --self_check=false
}

# quant_layout NAME: kvkeepd.json's layout for a DTYPES name (f32, bf16,
# fp8, int8, int4, kivi; a "-page" or "-all" suffix names the same layout).
quant_layout() {
  local dtype="${1%-page}"
  dtype="${dtype%-all}"
  if [ "$dtype" = f32 ]; then echo smollm2-135m; else echo "smollm2-135m-$dtype"; fi
}
