# A/B round (eighteenth session): d64 alone, where full attention at long sequences trails FA4
# most (ours / cuDNN 1.07-1.10, target 1.12). Sides: b = patches/d64-dq-permuted.patch (dQ staged
# under the 128-byte swizzle, 32-column boxes), c = patches/no-evict-last.patch (d64 full 16k
# -2.7% in long_seq_focus.sh's four rounds, inside the spread). Main-kernel ms of d64 16k full
# without a mask and with a zero bias, and d64 2k is_causal / causal bias (FA4 0.95 there).
#   bash tools/ab_rounds/d64_long_call.sh "$OUT"   (run from main; carry .whl)
timeout 60 python3 benchmarks/profile_bwd.py --b 1 --h 32 --s 16384 --d 64 --mask zeros --reps 5
timeout 60 python3 benchmarks/profile_bwd.py --b 8 --h 32 --s 2048 --d 64 --reps 10
