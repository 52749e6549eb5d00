# The walk's section size (sixteenth session, call 3 of BENCHMARKS.md): main kernel ms of GQA
# 32/8 and 16/8 `is_causal` d128 s8192 with the walk off, with the scheduler's own sections, and
# with TORCH_SM90_SDPA_SECTION_GROUPS = 2, 4, 8, all (head groups per section; a switch only
# patches/section-groups.patch has: in tree a the rows repeat main's own choice). Run from main:
#   tools/ab_session.sh /tmp/ab tools/ab_rounds/patches/section-groups.patch 1 -- bash tools/ab_rounds/gqa_walk_sections.sh
# (carry .whl). The measured run was of 5ad5d56 against the gqa-walk branch with the switch
# (before 9e68b21 landed the walk with sections of at least 128 CTAs).
P="python3 benchmarks/profile_bwd.py --s 8192 --d 128 --reps 5"
for h in "32 --kv-heads 8" "16 --kv-heads 8"; do
  echo "### walk off h=$h"; TORCH_SM90_SDPA_GQA_WALK=0 $P --b 2 --h $h 2>&1 | grep -v -i warn
  echo "### walk auto-section h=$h"; $P --b 2 --h $h 2>&1 | grep -v -i warn
  for sec in 2 4 8 0; do
    echo "### walk section=$sec h=$h"; TORCH_SM90_SDPA_SECTION_GROUPS=$sec $P --b 2 --h $h 2>&1 | grep -v -i warn
  done
done
