// Small device helpers of the main backward kernel: warpgroup GEMM issue, fragment type
// conversion, accumulator -> A-operand register layout, named barrier ids.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

namespace sm90_sdpa {
namespace kernel {

using namespace cute;

// Named barrier ids (CUTLASS adds its reserved offset; at most 8 user ids).
enum class BwdBarrier : uint32_t {
  kPdS = 0,      // all MMA threads: P / dS tiles written (or free to overwrite)
  kdQEmpty = 1,  // MMA threads + dQ-writer warp: the dQ smem slice may be written
  kdQFull = 2,   // MMA threads + dQ-writer warp: the dQ smem slice is ready for TMA
  kEpilogue = 3, // all MMA threads: epilogue smem ordering
};

// 2^x with subnormal results flushed to zero (ex2.approx.ftz). Without fast-math, exp2f wraps
// the same MUFU.EX2 in a range test and two multiplies per call to produce subnormal results
// (P < 2^-126), which no gradient needs (FlashAttention-3 flushes them too): 3 of the 4
// instructions of each of the 32 exponentials per thread and step, all of them between the
// S wgmma's wait and the dV issue, while the tensor cores idle. -inf -> +0, NaN -> NaN.
CUTE_DEVICE float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

CUTE_DEVICE void named_sync(int num_threads, BwdBarrier id) {
  cutlass::arch::NamedBarrier::sync(num_threads, static_cast<uint32_t>(id));
}
CUTE_DEVICE void named_arrive(int num_threads, BwdBarrier id) {
  cutlass::arch::NamedBarrier::arrive(num_threads, static_cast<uint32_t>(id));
}

// ---- deterministic mode: ordering the CTAs' reduce-adds through global-memory semaphores ----
// One thread per CTA uses these: wait for its turn, issue its TMA reduce-add, wait for the
// reduce to complete (not only for its shared-memory read), then pass the turn on.

// Spins until *flag == value (acquire, GPU scope), then orders this thread's later TMA
// (async-proxy) operations after the acquire.
CUTE_DEVICE void wait_for_turn(int const* flag, int value) {
  int seen;
  do {
    asm volatile("ld.global.acquire.gpu.b32 %0, [%1];" : "=r"(seen) : "l"(flag) : "memory");
  } while (seen != value);
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// Waits until every bulk async-group of this thread has completed, writes included.
CUTE_DEVICE void bulk_wait_all_complete() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// Makes this thread's completed TMA writes visible to the next waiter and passes the turn on
// (*flag += 1, release, GPU scope).
CUTE_DEVICE void pass_turn(int* flag) {
  asm volatile("fence.proxy.async.global;" ::: "memory");
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(flag) : "memory");
}

// Hides a pointer's value from the optimizer, so that values derived from it (GMMA smem
// descriptors of loop-invariant operands) are recomputed where used instead of being hoisted
// out of the m-block loop and kept in (or spilled from) registers.
template <class T>
CUTE_DEVICE T* launder_ptr(T* p) {
  asm volatile("" : "+l"(p));
  return p;
}

CUTE_DEVICE int launder_int(int x) {
  asm volatile("" : "+r"(x));
  return x;
}

// A thread's partition of a shared-memory tensor kept across the m-block loop as one int: the
// element offset of the thread's first value from the tensor's start (start: a smem_ptr, or
// the swizzle_ptr of a position-independent swizzle tensor, whose swizzle applies per access
// to the offset address), rebuilt where used with the partition's layout, which is static:
// the thread index goes into the offset alone. Partitioned from the thread index inside the
// loop, every use paid the thread's index math again (signed divisions, shifts: 20-70 integer
// instructions per step at d64 / d128, ncu and SASS of efc288c's parent).
template <class Partition, class Iterator>
CUTE_DEVICE int smem_partition_offset(Partition const& part, Iterator const& start) {
  static_assert(cute::is_static<decltype(part.layout())>::value, "a thread-independent layout");
  return int(cute::raw_pointer_cast(part.data()) - cute::raw_pointer_cast(start));
}
// (offset laundered: what derives from it is recomputed here, not kept live across the loop)
template <class PartitionLayout, class Iterator>
CUTE_DEVICE auto rebuild_smem_partition(Iterator const& start, int offset) {
  return cute::make_tensor(start + launder_int(offset), PartitionLayout{});
}

// One warpgroup-wide wgmma batch over all k-blocks of the operands:
//   C (+)= A * B, kWait >= 0: wait until at most kWait batches are in flight afterwards.
template <bool kZeroInit, int kWait, class TiledMma, class TA, class TB, class TC>
CUTE_DEVICE void wg_gemm(TiledMma& tiled_mma, TA const& tCrA, TB const& tCrB, TC& tCrC) {
  constexpr bool kIsRS =
      !cute::is_base_of<cute::GMMA::DescriptorIterator, typename TiledMma::FrgTypeA>::value;
  if constexpr (kIsRS) { warpgroup_fence_operand(const_cast<TA&>(tCrA)); }
  warpgroup_fence_operand(tCrC);
  warpgroup_arrive();
  if constexpr (kZeroInit) { tiled_mma.accumulate_ = GMMA::ScaleOut::Zero; }
  CUTLASS_PRAGMA_UNROLL
  for (int kb = 0; kb < size<2>(tCrA); ++kb) {
    cute::gemm(tiled_mma, tCrA(_, _, kb), tCrB(_, _, kb), tCrC);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (kWait >= 0) { warpgroup_wait<kWait>(); }
  warpgroup_fence_operand(tCrC);
  if constexpr (kIsRS) { warpgroup_fence_operand(const_cast<TA&>(tCrA)); }
}

// Element-wise conversion of a register fragment (same size), vectorized by CUTLASS.
template <class SrcTensor, class DstTensor>
CUTE_DEVICE void convert_fragment(SrcTensor const& src, DstTensor& dst) {
  using From = typename SrcTensor::value_type;
  using To = typename DstTensor::value_type;
  constexpr int N = decltype(size(src))::value;
  static_assert(N == decltype(size(dst))::value);
  cutlass::NumericArrayConverter<To, From, N> conv;
  *reinterpret_cast<cutlass::Array<To, N>*>(raw_pointer_cast(dst.data())) =
      conv(*reinterpret_cast<cutlass::Array<From, N> const*>(raw_pointer_cast(src.data())));
}

// A wgmma accumulator fragment ((2,2,V), MMA_M, MMA_N) of a 16-bit-converted tile, viewed as
// the register A operand ((2,2,2), MMA_M, (V/2, MMA_N)) of a following RS wgmma whose K
// dimension is this tile's N dimension. Valid because an m64nNk16 accumulator holds, per
// thread and per 16 columns, exactly the 8 values the A operand of an m64nXk16 wgmma needs,
// in the same register order.
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_layout_as_A_operand(Layout const& acc) {
  static_assert(decltype(rank(acc))::value == 3);
  static_assert(decltype(size<0, 0>(acc))::value == 2 && decltype(size<0, 1>(acc))::value == 2);
  static_assert(decltype(size<0, 2>(acc))::value % 2 == 0);
  auto v = logical_divide(layout<0, 2>(acc), Int<2>{});  // (2, V/2)
  return make_layout(make_layout(layout<0, 0>(acc), layout<0, 1>(acc), layout<0>(v)),
                     layout<1>(acc), make_layout(layout<1>(v), layout<2>(acc)));
}

}  // namespace kernel
}  // namespace sm90_sdpa
