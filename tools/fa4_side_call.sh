#!/usr/bin/env bash
# FlashAttention-4's SM90 backward side by side with ours and the stock backends (bench_bwd.py
# --fa4, interleaved in one run) on a prebuilt extension: the last of three device calls on one
# warm machine (tools/fetch_fa4.sh; the first two carry build/fa4/part1 and part1b and run
# `true`). This one
# carries build/fa4/part2, .whl and build/carry_gz: a call's prebuilt/ (the .so gzipped, its
# _build_config.py and prebuilt_sources.sha1), since 64 MiB per call leave no room for the .so
# unzipped beside part2.
#   GIT_COMMIT=$(git rev-parse --short HEAD) FA4_ARGS="--dims 64,128 --seqs 2048,8192,16384 --no-gqa" \
#     bash tools/fa4_side_call.sh "$OUT"
# OUTDIR gets summary.txt, check.txt, fa4_install.txt, fa4.txt and fa4.json.
set -uo pipefail
source "$(dirname "$0")/call_header.sh" "$@"
unpack_carry_gz || exit 2
use_prebuilt
install_fa4
args=${FA4_ARGS:---dims 64,128 --seqs 2048,8192,16384 --no-gqa}
# shellcheck disable=SC2086
PYTHONPATH="$FA4_PATH:$PYTHONPATH" timeout "${FA4_S:-400}" \
  python3 benchmarks/bench_bwd.py --fa4 $args --json "$OUTD/fa4.json" > "$OUTD/fa4.txt" 2>&1
stamp "bench_bwd --fa4 $args: exit $?, $(grep -E 'ours / (cudnn|fa4):' "$OUTD/fa4.txt" | tr '\n' ';')"
grep -E "^d=|^GQA|geometric" "$OUTD/fa4.txt"
cat "$OUTD/summary.txt"
