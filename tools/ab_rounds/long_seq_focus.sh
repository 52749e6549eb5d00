# A/B round (eighteenth session): the second look at two sides of long_seq_call.sh, whose one
# round (session 18, first call) could not tell them from noise: the d64 kernel, which side b
# leaves unchanged, moved 3% between trees a and b. Sides: b = patches/dq-per-wg.patch,
# c = patches/no-evict-last.patch. Main-kernel ms of: d128 16k full without a mask and with a
# zero bias (the masked kernel, b's 64-row tile), d128 16k is_causal and a causal bias (b's
# tile both), d64 16k full and zero bias (b's control; c changes it).
#   bash tools/ab_rounds/long_seq_focus_call.sh "$OUT"   (run from main; carry .whl)
timeout 60 python3 benchmarks/profile_bwd.py --b 1 --h 16 --s 16384 --d 128 --mask zeros --reps 5
timeout 60 python3 benchmarks/profile_bwd.py --b 1 --h 16 --s 16384 --d 128 --reps 5
timeout 60 python3 benchmarks/profile_bwd.py --b 1 --h 32 --s 16384 --d 64 --mask zeros --reps 5
