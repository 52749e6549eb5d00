#!/usr/bin/env bash
# One device call for tools/ab_rounds/xfail_numerics.py on a carried build (build/carry_gz: a
# landing call's prebuilt/, matching these C++ sources), the xfail's GQA shape and its MHA twin.
#   bash tools/ab_rounds/xfail_numerics_call.sh "$OUT"      (carry .whl and build/carry_gz)
set -uo pipefail
source "$(dirname "$0")/../call_header.sh" "$@"
unpack_carry_gz
use_prebuilt
for shape in 2,8,2,80,80 2,4,4,80,80; do
  timeout 120 python3 tools/ab_rounds/xfail_numerics.py --shape "$shape" >> "$OUTD/xfail.txt" 2>&1
  stamp "xfail_numerics --shape $shape: exit $?"
done
cat "$OUTD/xfail.txt"
