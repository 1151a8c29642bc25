#!/usr/bin/env bash
# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
#
# faults.sh SCENARIO RANKS TIMEOUT MPIEXEC [MPIEXEC FLAGS...] -- EXE
# Runs EXE (tests/mpi/fault_main.cpp) on RANKS processes, the last one failing with SCENARIO
# (throws, stalls, exits) under exchange_timeout = TIMEOUT seconds, and checks what every
# rank printed: issue 23's no-hang guarantees on MPI (docs/reliability.md).
set -u
scenario=$1 ranks=$2 timeout=$3
shift 3
cmd=()
while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do cmd+=("$1"); shift; done
shift
exe=$1
culprit=$((ranks - 1))
start=$(date +%s.%N)
out=$(timeout 50 "${cmd[@]}" "$exe" "$scenario" "$timeout" 2>&1)
rc=$?
elapsed=$(awk "BEGIN { print $(date +%s.%N) - $start }")
echo "$out"
echo "--- faults.sh: $scenario on $ranks ranks, exchange_timeout $timeout s: mpiexec exit $rc after $elapsed s"
fail() { echo "FAIL: $*"; exit 1; }
line() { grep "^epmoe-fault rank $1: " <<<"$out" | head -n 1; }
seconds() { sed -n 's/.* after \([0-9.]*\) s,.*/\1/p' <<<"$1"; }
below() { awk "BEGIN { exit !($1 < $2) }"; }
[ "$rc" -ne 124 ] || fail "the job hung: killed after 50 s"
checked=0
case "$scenario" in
  throws)
    l=$(line "$culprit")
    grep -q ": error after .* y untouched: injected: an expert GEMM failed" <<<"$l" ||
      fail "rank $culprit: expected its own error, got: $l"
    for ((r = 0; r < culprit; r++)); do
      l=$(line "$r")
      grep -q "comm_aborted(origin $culprit) after .* y untouched: .*rank $culprit failed mid-pass: .*injected: an expert GEMM failed" <<<"$l" ||
        fail "rank $r: expected comm_aborted naming rank $culprit, got: $l"
      # At once: within one exchange, not at the deadline.
      below "$(seconds "$l")" "$timeout" || fail "rank $r: took the deadline: $l"
      checked=$((checked + 1))
    done
    ;;
  stalls)
    for ((r = 0; r < culprit; r++)); do
      l=$(line "$r")
      grep -q "comm_timeout after .* y untouched: .*did not complete within $timeout s" <<<"$l" ||
        fail "rank $r: expected comm_timeout, got: $l"
      s=$(seconds "$l")
      below "$s" "$(awk "BEGIN { print $timeout + 1 }")" || fail "rank $r: past deadline + 1 s: $l"
      below "$(awk "BEGIN { print $timeout * 0.9 }")" "$s" || fail "rank $r: before the deadline: $l"
      checked=$((checked + 1))
    done
    ;;
  exits)
    # Either the survivors time out, or Open MPI ends the job when a process dies: both
    # within the deadline + 1 s (and the launcher's own reaction time).
    if [ -n "$(line 0)" ]; then
      for ((r = 0; r < culprit; r++)); do
        l=$(line "$r")
        grep -q "comm_timeout after .* y untouched" <<<"$l" ||
          fail "rank $r: expected comm_timeout, got: $l"
        below "$(seconds "$l")" "$(awk "BEGIN { print $timeout + 1 }")" || fail "rank $r: late: $l"
        checked=$((checked + 1))
      done
      echo "--- the survivors threw comm_timeout"
    else
      [ "$rc" -ne 0 ] || fail "the job ended with exit 0 and no rank's line"
      below "$elapsed" "$(awk "BEGIN { print $timeout + 10 }")" || fail "the job took $elapsed s"
      checked=$((checked + 1))
      echo "--- the launcher ended the job when rank $culprit died (exit $rc), before any deadline"
    fi
    ;;
  *) fail "unknown scenario $scenario" ;;
esac
[ "$checked" -gt 0 ] || fail "nothing checked"
echo "--- faults.sh: $scenario: passed ($checked checks)"
