#!/usr/bin/env bash
# Times memplan's allocator and MiniMalloc on the same problems, one after
# the other in one run, at each file's capacity (`A.1048576.csv`).
#
#   scripts/minimalloc_compare.sh /path/to/minimalloc [DIR] [THREADS...]
#
# The MiniMalloc binary is built outside this project (its code is never
# committed here). DIR defaults to fixtures/minimalloc; THREADS (default
# "1 0") are memplan thread counts to time, 0 meaning one per core. Every
# memplan layout passes the independent checker before it is counted.
set -euo pipefail
mm="${1:?give the path of a MiniMalloc binary}"
dir="${2:-fixtures/minimalloc}"
shift $(( $# >= 2 ? 2 : 1 ))
threads=("$@")
[ ${#threads[@]} -eq 0 ] && threads=(1 0)
cd "$(dirname "$0")/.."
cargo build --release -q -p memplan-allocator --no-default-features --example minimalloc_bench
bench="${CARGO_TARGET_DIR:-target}/release/examples/minimalloc_bench"
now() { date +%s.%N; }
printf '%-16s %12s' problem minimalloc_s
for t in "${threads[@]}"; do printf ' %14s' "memplan_t${t}_s"; done
printf '\n'
for f in "$dir"/*.csv; do
  name=$(basename "$f")
  cap=$(echo "$name" | sed -n 's/^.*\.\([0-9][0-9]*\)\.csv$/\1/p')
  [ -z "$cap" ] && continue
  s=$(now)
  "$mm" --input="$f" --capacity="$cap" >/dev/null 2>&1 || echo "minimalloc failed on $name" >&2
  e=$(now)
  printf '%-16s %12.3f' "$name" "$(awk -v e="$e" -v s="$s" 'BEGIN { print e - s }')"
  for t in "${threads[@]}"; do
    row=$("$bench" --time-limit 60 --threads "$t" "$f" | tail -1)
    status=$(echo "$row" | awk '{print $6}')
    secs=$(echo "$row" | awk '{print $7}')
    printf ' %8s %5s' "$secs" "${status:0:4}"
  done
  printf '\n'
done
