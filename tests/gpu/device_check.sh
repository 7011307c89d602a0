#!/usr/bin/env bash
# The GPU device check: one prepared run on a machine with one NVIDIA GPU
# (an H200 in this project) that has CUDA and CMake but no Debian -dev
# packages. It builds the core, the CUDA kernels and their tests with every
# core (gRPC services left out), runs
#   1. the GPU tests (label gpu): each CUDA kernel against its CPU twin,
#      the CUDA page memory's step batches against the host memory's
#      (gpu_step_batch_test), CUDA IPC from a second process;
#   2. the whole store suite with its pools on the GPU
#      (KVKEEP_TEST_DEVICE=cuda:0), so every session call runs its batches
#      on the CUDA memory (step_batch_test counts them);
#   3. the kernel benchmarks (bench/gpu/kernel_bench) and the decode step's
#      batch through the CUDA page memory, 32 layers at 32k tokens
#      (bench/gpu/step_bench: step=... us=... against target_us=400);
# and writes summary.txt and the logs under $OUT (or ./device-check-out).
# It ends well inside 8 minutes: each step has its own timeout.
#
# Needs .device/ (tests/gpu/prepare_carry.sh; carry it). Without a GPU it
# still builds and runs what runs on a CPU (the rehearsal: the GPU tests
# skip, step 2 and 3 are skipped).
#   usage: tests/gpu/device_check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-$PWD/device-check-out}"
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"
say() { echo "$*" | tee -a "$summary"; }
started=$SECONDS

say "== machine"
say "os: $(. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME") ($(uname -srm))"
say "cxx: $(c++ --version 2>/dev/null | head -1)"
say "nvcc: $(nvcc --version 2>/dev/null | tail -1)"
say "cmake: $(cmake --version | head -1)"
say "cores: $(nproc)"
have_gpu=0
if nvidia-smi -L >/dev/null 2>&1; then
  have_gpu=1
  say "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total \
    --format=csv,noheader | head -1)"
else
  say "gpu: none (rehearsal: GPU tests skip, GPU runs are left out)"
fi

if [ ! -d .device/googletest ] || [ ! -d .device/root/usr ]; then
  say "FAIL: .device/ is missing: run tests/gpu/prepare_carry.sh and carry it"
  exit 1
fi

# NCCL for the NCCL link tests: the loader's, or the copy PyTorch's wheel
# ships (nvidia-nccl), named by KVKEEP_NCCL_LIBRARY.
if [ -z "${KVKEEP_NCCL_LIBRARY:-}" ] && ! ldconfig -p 2>/dev/null | grep -q libnccl.so.2; then
  lib=$(python3 -c 'import nvidia.nccl as n; print(list(n.__path__)[0] + "/lib/libnccl.so.2")' 2>/dev/null)
  [ -n "$lib" ] && [ -f "$lib" ] && export KVKEEP_NCCL_LIBRARY="$lib"
fi
say "nccl: ${KVKEEP_NCCL_LIBRARY:-$(ldconfig -p 2>/dev/null | grep -m1 libnccl.so.2 | sed 's/.*=> //')}"

build=build-gpu
say "== build ($build)"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
# The carried prefix comes first (the device machine has no system Abseil;
# the check below makes sure the rehearsal does not lean on this machine's).
if ! timeout 120 cmake -S . -B "$build" "${generator[@]}" \
    -DCMAKE_BUILD_TYPE=Release -DKVKEEP_BUILD_SERVICES=OFF \
    -DKVKEEP_BUILD_BENCH=OFF -DKVKEEP_CUDA=ON \
    -DKVKEEP_GTEST_SOURCE_DIR="$PWD/.device/googletest" \
    -DCMAKE_PREFIX_PATH="$PWD/.device/root/usr" >"$out/configure.log" 2>&1; then
  say "FAIL: configure (configure.log)"
  tail -30 "$out/configure.log"
  exit 1
fi
for pkg in absl nlohmann_json; do
  dir=$(sed -n "s/^${pkg}_DIR:PATH=//p" "$build/CMakeCache.txt")
  say "$pkg from: $dir"
  case "$dir" in
    "$PWD/.device/"*) ;;
    *) say "FAIL: $pkg was not found in .device/"; exit 1 ;;
  esac
done
if ! timeout 300 cmake --build "$build" --parallel "$(nproc)" \
    >"$out/build.log" 2>&1; then
  say "FAIL: build (build.log)"
  grep -E "error|Error" -A3 "$out/build.log" | head -40
  exit 1
fi
say "built in $((SECONDS - started)) s"

status=0
run_ctest() {  # NAME TIMEOUT ctest-args...
  local name="$1" limit="$2"
  shift 2
  timeout "$limit" ctest --test-dir "$build" --output-on-failure \
    --parallel "$(nproc)" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  say "$name: $(grep -E "tests passed|No tests were found" "$out/$name.log" |
    tail -1) (exit $rc)"
  local skipped
  skipped=$(grep -c "Test *#.*Skipped" "$out/$name.log")
  say "$name: $skipped skipped"
  [ $rc -eq 0 ] || {
    status=1
    grep -E "Failed|FAILED|\*\*\*" "$out/$name.log" | head -20 | tee -a "$summary"
  }
}

say "== GPU tests (label gpu)"
run_ctest gpu_tests 150 -L gpu
if [ $have_gpu -eq 1 ]; then
  say "== the store suite on cuda:0"
  KVKEEP_TEST_DEVICE=cuda:0 run_ctest store_on_cuda 150 -LE gpu
  say "== kernel and step benchmarks"
  for bench in kernel_bench step_bench; do
    if timeout 90 "$build/bin/$bench" >"$out/$bench.log" 2>&1; then
      grep -E "^(kernel=|step=|peak|device)" "$out/$bench.log" |
        tee -a "$summary"
    else
      say "FAIL: $bench ($bench.log)"
      tail -20 "$out/$bench.log"
      status=1
    fi
  done
else
  say "== the store suite on the host (no GPU)"
  run_ctest store_on_host 150 -LE gpu
fi
say "== done in $((SECONDS - started)) s, status $status"
exit $status
