#!/usr/bin/env bash
# One device call: all variants built (tools/device_session.sh, smoke test only; prebuilt/ saved
# for PREBUILT=1 later), then where the public paths spend their time next to stock's own:
# tools/public_path_probe.py --latency and --host (our op and drop-in beside cuDNN's aten op and
# cuDNN's public path), bench_bwd's grid with --extra --dropin (the "public" and "agree"
# columns), and Nsight Compute (--set full) on the main kernel of d256 b8 h8 s2048 is_causal.
#   GIT_COMMIT=$(git rev-parse --short HEAD) bash tools/public_latency_call.sh "$OUT"  (carry .whl)
# About 7-8 minutes (estimated: build 235 s, probes 60 s, bench 90 s, ncu 90 s).
set -uo pipefail
source "$(dirname "$0")/call_header.sh" "$@"
build_all /tmp/latency_logs

timeout 90 python3 tools/public_path_probe.py --latency > "$OUTD/latency.txt" 2>&1
stamp "public_path_probe --latency: exit $?"
timeout 60 python3 tools/public_path_probe.py --host > "$OUTD/host_timeline.txt" 2>&1
stamp "public_path_probe --host: exit $?"
timeout 150 python3 benchmarks/bench_bwd.py --extra --dropin --json "$OUTD/bench_bwd_dropin.json" \
  > "$OUTD/bench_bwd_dropin.txt" 2>&1
stamp "bench_bwd --extra --dropin: exit $?, $(grep -E 'ours / cudnn:|public paths|paths agree' "$OUTD/bench_bwd_dropin.txt" | tr '\n' ';')"
timeout 150 ncu --clock-control none --set full -k regex:bwd_main_kernel -c 1 -f -o "$LOGS/ncu_d256" \
  python3 benchmarks/profile_bwd.py --once --b 8 --h 8 --s 2048 --d 256 > "$LOGS/ncu.log" 2>&1
stamp "ncu d256 is_causal: exit $?"
ncu --import "$LOGS/ncu_d256.ncu-rep" --page details > "$OUTD/ncu_d256_details.txt" 2>&1
tar czf "$OUTD/logs.tgz" -C "$LOGS" --exclude='*.so' .
cat "$OUTD/latency.txt"
grep -E "^d=|geometric" "$OUTD/bench_bwd_dropin.txt" | tail -n 70
cat "$OUTD/summary.txt"
