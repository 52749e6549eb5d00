# A/B round (prepared in the nineteenth session, not run yet): P converted to 16 bits before the
# wait for dP (patches/p-convert-early.patch, branch p-convert-early; FA4's order). Main-kernel
# ms of the rows furthest from issue 8's targets: d128 full 16k (1.04-1.05x, target 1.12),
# d128 / d256 is_causal at 2k and 8k (d256: 0.93-0.95x).
#   bash tools/ab_rounds/p_convert_call.sh "$OUT"   (run from main; carry .whl)
timeout 60 python3 benchmarks/profile_bwd.py --b 1 --h 16 --s 16384 --d 128 --mask zeros --reps 5
timeout 60 python3 benchmarks/profile_bwd.py --b 2 --h 16 --s 8192 --d 128 --reps 5
timeout 60 python3 benchmarks/profile_bwd.py --b 8 --h 8 --s 2048 --d 256 --reps 10
timeout 60 python3 benchmarks/profile_bwd.py --b 2 --h 8 --s 8192 --d 256 --reps 5
