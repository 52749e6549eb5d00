# A/B round (nineteenth session): K and V on separate barriers, V issued after the first Q stage
# (patches/split-kv-barrier.patch, branch split-kv-barrier), at d256 where CTAs are short under
# is_causal (2k keys: 1 to 32 m-blocks each) and ours trails cuDNN (0.93-0.95x at 2k-8k).
# Main-kernel ms of is_causal / causal bias at 2k and 8k keys and of full / zero bias at 2k.
#   bash tools/ab_rounds/split_kv_call.sh "$OUT"   (run from main; carry .whl)
timeout 60 python3 benchmarks/profile_bwd.py --b 8 --h 8 --s 2048 --d 256 --reps 10
timeout 60 python3 benchmarks/profile_bwd.py --b 2 --h 8 --s 8192 --d 256 --reps 5
timeout 60 python3 benchmarks/profile_bwd.py --b 8 --h 8 --s 2048 --d 256 --mask zeros --reps 10
