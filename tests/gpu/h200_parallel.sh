#!/usr/bin/env bash
# Correctness steps of tests/gpu/h200_session.sh side by side on the one GPU (their compiles
# are CPU-bound and single-threaded; float64 checks need no quiet GPU; never benchmarks):
#   bash tests/gpu/h200_parallel.sh "softcap-tests softcap-tests2" "decode-tests" ...
# Each quoted group runs in order in its own process, with its logs under $OUT/g<N>; all of
# them come back as one file, $OUT/parallel.tar.gz (the device tool returns few files).
# The groups share the kernel disk cache, so a kernel one group compiles another loads.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
here=$(cd "$(dirname "$0")" && pwd)
n=0; pids=()
for group in "$@"; do
  n=$((n + 1))
  # shellcheck disable=SC2086
  OUT="$OUT/g$n" bash "$here/h200_session.sh" $group > "$OUT/g$n.txt" 2>&1 &
  pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
for i in $(seq 1 $n); do echo "##### group $i: ${!i}"; cat "$OUT/g$i.txt"; done | cut -c1-400
tar czf "$OUT/parallel.tar.gz" -C "$OUT" $(cd "$OUT" && ls -d g*) && rm -rf "$OUT"/g*
exit $status
