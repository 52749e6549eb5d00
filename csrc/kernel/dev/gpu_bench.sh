#!/usr/bin/env bash
# GPU-machine call: benchmark dev-shim libraries (LIB:DIM ...) against cuDNN / flash; checks for
# libraries given as check:LIB:DIM. Logs in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export PYTHONUNBUFFERED=1
for a in "$@"; do
  if [ "${a%%:*}" = check ]; then
    r=${a#check:}; l=${r%%:*}; d=${r##*:}
    timeout 100 python3 csrc/kernel/dev/dev_test.py $l --dims $d --dtypes bf16 --quick > $OUT/check_d$d.log 2>&1
    echo "d$d check rc=$?"; grep -E "FAIL|passed|Error" $OUT/check_d$d.log | head -20
  else
    l=${a%%:*}; d=${a##*:}
    timeout 150 python3 -c "
import sys; sys.path.insert(0,'csrc/kernel/dev')
import dev_test
dev_test.bench(dev_test.Shim('$l'), [$d])
" > $OUT/bench_d$d.log 2>&1; echo "bench d$d rc=$?"; grep -v Warn $OUT/bench_d$d.log | tail -8
  fi
done
