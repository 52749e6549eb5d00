#!/usr/bin/env bash
# One GPU-machine call over dev-shim libraries: checks, benchmark, memcheck. Logs in $OUT.
# Usage (GPU machine, repo root): csrc/kernel/dev/gpu_run.sh MAINLIB MAINDIMS [bench] [extra LIB:DIM ...]
set -uo pipefail
LIB=$1; DIMS=$2; MODE=${3:-}; shift 3 || shift $#
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export PYTHONUNBUFFERED=1
T=csrc/kernel/dev/dev_test.py
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee $OUT/gpu.txt
timeout 150 python3 $T $LIB --dims $DIMS --quick > $OUT/check_main.log 2>&1; echo "main check rc=$?"
grep -E "FAIL|passed|Error|error" $OUT/check_main.log | head -40
if [ "$MODE" = bench ]; then
  timeout 120 python3 -c "
import sys; sys.path.insert(0,'csrc/kernel/dev')
import dev_test
dev_test.bench(dev_test.Shim('$LIB'), [int(x) for x in '$DIMS'.split(',')])
" > $OUT/bench.log 2>&1; echo "bench rc=$?"; cat $OUT/bench.log | tail -20
fi
for ld in "$@"; do
  l=${ld%%:*}; d=${ld##*:}
  timeout 90 python3 $T $l --dims $d --dtypes bf16 --quick > $OUT/check_d$d.log 2>&1; echo "d$d check rc=$?"
  grep -E "FAIL|passed|Error|error" $OUT/check_d$d.log | head -20
done
if command -v compute-sanitizer >/dev/null; then
  timeout 120 compute-sanitizer --tool memcheck python3 $T $LIB --dims ${DIMS%%,*} --one > $OUT/memcheck.log 2>&1
  echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|Invalid" $OUT/memcheck.log | head -5
fi
