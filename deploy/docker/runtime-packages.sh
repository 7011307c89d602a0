#!/usr/bin/env bash
# Prints the Debian (or Ubuntu) packages that provide the shared libraries
# the given binaries load, one per line, sorted: what a runtime image must
# install for them. Uses ldd and dpkg -S, so run it where the binaries were
# built.
#   runtime-packages.sh BINARY...
#   runtime-packages.sh --check LIST BINARY...
# With --check it also fails (status 1) if a needed package is missing from
# LIST (one package a line, '#' comments), naming it.
set -euo pipefail

list=""
if [ "${1:-}" = "--check" ]; then
  list="$2"
  shift 2
fi
[ $# -gt 0 ] || { echo "usage: $0 [--check LIST] BINARY..." >&2; exit 2; }

# dpkg records a library under the path its package shipped it at; with a
# merged /usr that may be /lib/... or /usr/lib/..., whichever ldd printed.
candidates() {
  local lib="$1" real
  real="$(readlink -f "$lib")"
  printf '%s\n' "$lib" "$real" "/usr$lib" "/usr$real" "${lib#/usr}" "${real#/usr}"
}

libs="$(for bin in "$@"; do
  ldd "$bin" | awk '/=> \// { print $3 } /^\t\// { print $1 }'
done | sort -u)"

# One dpkg-query for every candidate path (each call reads the whole
# database): "package[:arch]: path" per path some package owns.
declare -A owner_of
while IFS= read -r line; do
  pkg="${line%%: *}"
  owner_of["${line#*: }"]="${pkg%%:*}"
done < <(for lib in $libs; do candidates "$lib"; done | sort -u |
           xargs dpkg-query -S 2>/dev/null || true)

needed="$(
  for lib in $libs; do
    found=""
    for p in $(candidates "$lib"); do
      [ -n "${owner_of[$p]:-}" ] && { found="${owner_of[$p]}"; break; }
    done
    [ -n "$found" ] || { echo "runtime-packages: no package owns $lib" >&2; exit 1; }
    echo "$found"
  done | sort -u
)"
echo "$needed"

if [ -n "$list" ]; then
  missing="$(comm -23 <(echo "$needed") \
    <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$list" | grep -v '^$' | sort -u))"
  if [ -n "$missing" ]; then
    # shellcheck disable=SC2086  # the names on one line
    echo "runtime-packages: missing from $list:" $missing >&2
    exit 1
  fi
fi
