#!/usr/bin/env bash
# The simulator's validation table (docs/simulator.md): threads and MPI x small and large
# shapes x uniform and Zipf 1.2, REPS runs of each, then one markdown table of the median
# errors. Needs an MPI build (the default preset).
#   bash bench/sim/validate_all.sh [BUILD_DIR (build/default)] [REPS (2)] [OUT (build/validation)]
set -euo pipefail
B=${1:-build/default}
REPS=${2:-2}
OUT=${3:-build/validation}
mkdir -p "$OUT"
big="--tokens 2048 --hidden 1024 --ffn 256"
for rep in $(seq 1 "$REPS"); do
  for shape in small big; do
    args=""; [ "$shape" = big ] && args=$big
    for skew in "" "--skew 1.2"; do
      tag="$shape${skew:+-zipf}-$rep"
      # shellcheck disable=SC2086
      "$B/examples/epmoe_simulate" --validate $args $skew > "$OUT/threads-$tag.txt"
      # shellcheck disable=SC2086
      mpiexec --allow-run-as-root -n 2 "$B/bench/epmoe_sim_validate_mpi" $args $skew \
        > "$OUT/mpi-$tag.txt"
    done
  done
done
/usr/bin/env python3 "$(dirname "$0")/validation_table.py" "$OUT" "$REPS"
