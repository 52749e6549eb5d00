#!/usr/bin/env bash
# The device call after tools/landing_call.sh (fifteenth session): with that call's build
# carried (PREBUILT=1: gunzip its prebuilt/_C*.so.gz into torch_sm90_sdpa/ beside its
# _build_config.py and prebuilt_sources.sha1, and carry those three and .whl), a second
# `bench_bwd.py --extra --json` run, the speed table regenerated from it and the first run
# (benchmarks/results/*.json, as committed), then the compiled 8-block GPT of the demo routed
# as the default enable() does (--only-faster, with that table) and the public paths
# (tools/public_path_probe.py --batched).
#   GIT_COMMIT=$(git rev-parse --short HEAD) bash tools/second_run_call.sh "$OUT"
# OUTDIR gets summary.txt, bench_bwd_full_run2.json, speed_table.py, bench_bwd.txt, demo.txt,
# public_paths.txt, check.txt.
set -uo pipefail
source "$(dirname "$0")/call_header.sh" "$@"

use_prebuilt

python3 benchmarks/bench_bwd.py --extra --json "$OUTD/bench_bwd_full_run2.json" \
  > "$OUTD/bench_bwd.txt" 2>&1
stamp "bench_bwd --extra: exit $?, $(grep 'ours / cudnn' "$OUTD/bench_bwd.txt" | tail -n 1)"
cp "$OUTD/bench_bwd_full_run2.json" benchmarks/results/
python3 tools/speed_table.py benchmarks/results/*.json -o torch_sm90_sdpa/speed_table.py \
  > /dev/null 2>&1
stamp "speed table: exit $?"
cp torch_sm90_sdpa/speed_table.py "$OUTD/"

gpt_demo demo.txt 300

timeout 150 python3 tools/public_path_probe.py --batched > "$OUTD/public_paths.txt" 2>&1
stamp "public_path_probe --batched: exit $?"
grep -E "^GQA|^d=128 causal|geometric" "$OUTD/bench_bwd.txt"
grep -E "replaced|kept stock|speed|step |routing_stats" "$OUTD/demo.txt"
grep -v Warning "$OUTD/public_paths.txt" | tail -n 20
cat "$OUTD/summary.txt"
