# EXPERIMENT (sixteenth session, branch gqa-walk-exp): the walk's causal slowdown against the
# scheduler's section size (TORCH_SM90_SDPA_SECTION_GROUPS, head groups per section, 0 = all:
# a switch only patches/gqa-walk-exp.patch has). Run from main with
#   tools/ab_session.sh /tmp/ab tools/ab_rounds/patches/gqa-walk-exp.patch 1 -- bash tools/ab_rounds/gqa_walk_sections.sh
# (carry .whl); figures in BENCHMARKS.md (sixteenth session, call 3).
P="python3 benchmarks/profile_bwd.py --s 8192 --d 128 --reps 5"
if ! grep -q heads_per_cta csrc/bwd_params.h; then
  for h in "32 --kv-heads 8" "16 --kv-heads 8"; do echo "### main h=$h"; $P --b 2 --h $h 2>&1 | grep -v -i warn; done
  exit 0
fi
for h in "32 --kv-heads 8" "16 --kv-heads 8"; do
  echo "### walk off h=$h"; TORCH_SM90_SDPA_GQA_WALK=0 $P --b 2 --h $h 2>&1 | grep -v -i warn
  echo "### walk auto-section h=$h"; $P --b 2 --h $h 2>&1 | grep -v -i warn
  for sec in 2 4 8 0; do
    echo "### walk section=$sec h=$h"; TORCH_SM90_SDPA_SECTION_GROUPS=$sec $P --b 2 --h $h 2>&1 | grep -v -i warn
  done
done
