# A lighter round of the d256-ds2 A/B (d256_ds2.sh, same trees) for a call with about 450 s of
# device time left (fifteenth session): bench_bwd at d256 with 5 repeats (--check), then the
# main-kernel ms of is_causal at 2k keys (GQA 8/2) and of full at 8k.
#   TORCH_SM90_SDPA_HEAD_DIMS=256 bash tools/ab_rounds/ab_call.sh "$OUT" \
#     tools/ab_rounds/patches/d256-ds2.patch tools/ab_rounds/d256_ds2_quick.sh "256 and causal"
python3 benchmarks/bench_bwd.py --dims 256 --seqs 2048,8192 --no-gqa --reps 5 --check
python3 benchmarks/profile_bwd.py --b 8 --h 8 --kv-heads 2 --s 2048 --d 256 --reps 5
python3 benchmarks/profile_bwd.py --b 2 --h 8 --s 8192 --d 256 --mask zeros --reps 5
