# Shared by scripts/test and scripts/run: install what is missing, configure
# and build. Sourced, not executed.

# Debian packages the build and the tests need.
KVKEEP_PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config
  libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  python3-grpcio openssl
  prometheus-cpp-dev prometheus python3-yaml
  libopenblas-dev python3-venv
)

kvkeep_install_missing() {
  local missing=()
  for p in "${KVKEEP_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' ||
      missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "kvkeep: installing missing packages: ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    "${missing[@]}"
}

# kvkeep_openblas_env: names OpenBLAS's kernel set from the CPU's flags
# unless OPENBLAS_CORETYPE is set. Debian's OpenBLAS 0.3.21 does not
# recognise some AVX-512 Xeons (it reports "Prescott") and falls back to its
# SSE3 kernels: kvkeep-lm's forward pass then takes 1.8x the CPU
# (docs/lm.md), sgemm 3x. OpenBLAS reads the variable when it loads, so it
# must be in the environment of the process that links it.
kvkeep_openblas_env() {
  [ -n "${OPENBLAS_CORETYPE:-}" ] && return 0
  local flags
  flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null) "
  if [[ $flags == *" avx512bw "* && $flags == *" avx512vl "* &&
    $flags == *" avx512dq "* ]]; then
    export OPENBLAS_CORETYPE=SkylakeX
  elif [[ $flags == *" avx2 "* && $flags == *" fma "* ]]; then
    export OPENBLAS_CORETYPE=Haswell
  fi
  return 0
}

# kvkeep_build BUILD_DIR "TARGET..." [extra cmake args...]  ("all" for all)
kvkeep_build() {
  local dir="$1" targets="$2"
  shift 2
  export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/kvkeep-ccache}"
  # Paths relative to the checkout, so another clone (CI's, a worktree) hits
  # the cache; without NOHASHDIR ccache hashes the build folder into every
  # -g compile (RelWithDebInfo) and no other clone ever hits. The cost: a hit
  # carries the first clone's folder in its debug info (gdb's source paths).
  export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"
  export CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-1}"
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
  # shellcheck disable=SC2086  # one argument per target
  cmake --build "$dir" --target $targets --parallel "$(nproc)"
}

# kvkeep_start_kvkeepd BIN LOG [kvkeepd args...]: starts kvkeepd in the
# background with its output in LOG and waits for its "grpc listening on"
# line; sets KVKEEPD_PID and KVKEEPD_ADDRESS. Fails, printing the log, if it
# exits or prints no address within a minute.
kvkeep_start_kvkeepd() {
  local bin="$1" log="$2"
  shift 2
  "$bin" "$@" >"$log" 2>&1 &
  KVKEEPD_PID=$!
  KVKEEPD_ADDRESS=""
  for _ in $(seq 600); do
    KVKEEPD_ADDRESS="$(sed -n 's/^kvkeepd: grpc listening on //p' "$log")"
    [ -n "$KVKEEPD_ADDRESS" ] && return 0
    kill -0 "$KVKEEPD_PID" 2>/dev/null || break
    sleep 0.1
  done
  cat "$log" >&2
  echo "kvkeepd did not start" >&2
  return 1
}
