#!/usr/bin/env bash
# GPU-machine call with a prebuilt extension (torch_sm90_sdpa/_C*.so carried): the op-level
# numerics tests of the main kernel, a SASS check and the benchmark. Logs in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
so=$(ls torch_sm90_sdpa/_C*.so | head -1)
python3 -c "from torch_sm90_sdpa import _extension as e; i=e.build_info(); print('variants', i['variants'], i['reason'])" 2>&1 | tail -1
(cuobjdump -sass $so | grep -c HGMMA; cuobjdump -sass $so | grep -cE "\bSTL\b|\bLDL\b") 2>&1 | tr '\n' ' '; echo " (HGMMA, STL/LDL)"
timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q -p no:cacheprovider tests/test_cuda_backward.py ${TEST_ARGS:-} \
  --junitxml=$OUT/junit.xml > $OUT/tests.log 2>&1; echo "pytest rc=$?"
grep -E "passed|failed|error" $OUT/tests.log | tail -3; grep -E "^FAILED|^ERROR" $OUT/tests.log | head -30
if [ "${BENCH:-1}" = 1 ]; then
  timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/bench_bwd.py ${BENCH_ARGS:---quick} > $OUT/bench.log 2>&1
  echo "bench rc=$?"; cat $OUT/bench.log
fi
