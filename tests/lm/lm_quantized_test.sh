#!/usr/bin/env bash
# kvkeep-lm on quantised layouts (tests/lm/data/kvkeepd_quantized.json: f32,
# bf16, fp8_e4m3, int8, int4 with groups of 32, host pools shared), against
# a real kvkeepd, on the GPL-3 text every Debian machine has:
#  - byte-exact reading: for every quantised layout, the perplexity of full
#    and of h2o (which evicts and compacts) is the same to the last bit
#    whether kvkeep-lm reads the store's pages in place (mapped: the records
#    kvkeepd made, read through the CPU twin) or its mirror (the records the
#    worker's own CPU twin made of what it sent);
#  - closeness: full's perplexity on int8 within 2% of f32's, fp8_e4m3
#    within 8%, int4 within 25%, and bf16 < int8 < int4 in error
#    (measured 2026-12-02 on these 192 tokens: f32 23.680, bf16 +0.09%,
#    int8 +1.07%, fp8_e4m3 +4.95%, int4 +13.5%);
#  - the KV bytes the store reports follow the records' size.
# Prints "SKIPPED: ..." (ctest: skipped) when the model file is absent.
#
#   lm_quantized_test.sh BIN_DIR CONFIG MODEL
source "$(dirname "$0")/lm_test_lib.sh"
lm_start_kvkeepd
text=/usr/share/common-licenses/GPL-3
runs="full h2o:sinks=4,recent=16@64"
lm() {
  "$bin/kvkeep-lm" perplexity --model="$model" --text="$text" --json \
    --server="$KVKEEPD_ADDRESS" --max_tokens=192 --runs="$runs" "$@"
}

f32="$(field "$(lm --layout=smollm2-135m)" full perplexity)"
echo "f32: full $f32"
declare -A ppl bytes
for dtype in bf16 fp8 int8 int4; do
  mapped="$(lm --layout=smollm2-135m-$dtype --cache=mapped)"
  mirror="$(lm --layout=smollm2-135m-$dtype --cache=mirror)"
  for run in $runs; do
    a="$(field "$mapped" "$run" perplexity)"
    b="$(field "$mirror" "$run" perplexity)"
    echo "$dtype $run: mapped $a, mirror $b"
    [ "$a" = "$b" ] || fail "$dtype $run: mapped $a != mirror $b"
  done
  ppl[$dtype]="$(field "$mapped" full perplexity)"
  bytes[$dtype]="$(field "$mapped" full resident_kv_bytes)"
done
# 192 tokens x 30 layers in pages of 16: 12 pages a layer, 2 x 16 records a
# page (bf16 384 bytes a token, fp8_e4m3 204, int8 210, int4 114).
for pair in bf16:384 fp8:204 int8:210 int4:114; do
  want=$((30 * 12 * 2 * 16 * ${pair#*:}))
  [ "${bytes[${pair%:*}]}" = "$want" ] ||
    fail "${pair%:*} holds ${bytes[${pair%:*}]} bytes, expected $want"
done
within "${ppl[int8]}" "$f32" 0.02 || fail "int8 ${ppl[int8]} not within 2% of f32 $f32"
within "${ppl[fp8]}" "$f32" 0.08 || fail "fp8 ${ppl[fp8]} not within 8% of f32 $f32"
within "${ppl[int4]}" "$f32" 0.25 || fail "int4 ${ppl[int4]} not within 25% of f32 $f32"
err() { python3 -c 'import sys; print(abs(float(sys.argv[1])-float(sys.argv[2])))' "$1" "$f32"; }
less "$(err "${ppl[bf16]}")" "$(err "${ppl[int8]}")" || fail "bf16 not closer than int8"
less "$(err "${ppl[int8]}")" "$(err "${ppl[int4]}")" || fail "int8 not closer than int4"
echo "PASS"
