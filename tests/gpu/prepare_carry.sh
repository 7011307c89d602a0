#!/usr/bin/env bash
# Fills .device/ (git-ignored) with what the GPU device check needs to build
# the core on a machine with CUDA and CMake but no Debian -dev packages:
#   .device/googletest   GoogleTest sources (Debian's /usr/src/googletest)
#   .device/root/usr     libabsl-dev + its runtime and nlohmann-json3-dev,
#                        unpacked with dpkg -x (found via CMAKE_PREFIX_PATH)
# Run it here (Debian 12), then name .device in the device call's `carry`.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/lib.sh
kvkeep_install_missing  # libgtest-dev brings /usr/src/googletest

out=.device
rm -rf "$out"
mkdir -p "$out/root" "$out/debs"
cp -r /usr/src/googletest "$out/googletest"
(cd "$out/debs" && apt-get download libabsl-dev libabsl20220623 \
  nlohmann-json3-dev 2>&1 | grep -v "^W: Download is performed unsandboxed")
for deb in "$out"/debs/*.deb; do dpkg -x "$deb" "$out/root"; done
rm -rf "$out/debs"
# Only what a build reads: headers, CMake configs, shared libraries.
rm -rf "$out/root/usr/share/doc" "$out/root/usr/share/lintian"
du -sh "$out"
