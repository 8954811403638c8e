// common.cuh — what aieng's attention kernels share beyond the element types of
// dtype_convert.cuh: packing two floats into one 32-bit MMA operand and the m16n8k16
// tensor-core MMA, in inline PTX (NVRTC gets no toolkit headers, so no mma.h). sm_80 or newer.
#pragma once

#include "dtype_convert.cuh"

typedef unsigned int u32;

#define AIENG_NEG_INF (-__uint_as_float(0x7f800000u))

// Two floats -> one register of two 16-bit values (lo in the low half), round to nearest even.
template <typename T>
__device__ __forceinline__ u32 pack2(float lo, float hi);
template <>
__device__ __forceinline__ u32 pack2<f16_t>(float lo, float hi) {
#ifdef __CUDA_ARCH__
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else  // the host emulation of tests/cuda_host/emulate.h
  return host_float_to_half(lo) | (u32(host_float_to_half(hi)) << 16);
#endif
}
template <>
__device__ __forceinline__ u32 pack2<bf16_t>(float lo, float hi) {
#ifdef __CUDA_ARCH__
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return host_float_to_bf16(lo) | (u32(host_float_to_bf16(hi)) << 16);
#endif
}

// D (16x8, f32) += A (16x16, row-major) * B (16x8, column-major), A and B in T (f16_t or
// bf16_t). Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16"), with g = lane / 4 and
// t = lane % 4: a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..2t+1], a[2] = A[g][2t+8..2t+9],
// a[3] = A[g+8][2t+8..2t+9]; b[0] = B[2t..2t+1][g], b[1] = B[2t+8..2t+9][g];
// d[0..1] = D[g][2t..2t+1], d[2..3] = D[g+8][2t..2t+1].
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]);
template <>
__device__ __forceinline__ void mma_16816<f16_t>(float (&d)[4], const u32 (&a)[4],
                                                 const u32 (&b)[2]) {
#ifdef __CUDA_ARCH__
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  host_mma_16816(d, a, b, f16_t{});
#endif
}
template <>
__device__ __forceinline__ void mma_16816<bf16_t>(float (&d)[4], const u32 (&a)[4],
                                                  const u32 (&b)[2]) {
#ifdef __CUDA_ARCH__
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  host_mma_16816(d, a, b, bf16_t{});
#endif
}

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Eight consecutive int8 values (8-byte aligned) as floats: one 64-bit load.
__device__ __forceinline__ void load8(const signed char* p, float out[8]) {
  const uint2 v = *reinterpret_cast<const uint2*>(p);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[i] = static_cast<float>(static_cast<signed char>(v.x >> (8 * i)));
    out[4 + i] = static_cast<float>(static_cast<signed char>(v.y >> (8 * i)));
  }
}

// Instantiation filters: -DAIENG_DTYPE=1 (float16) or 2 (bfloat16), -DAIENG_INT8=0 or 1 (the
// cache), -DAIENG_HEAD_DIM=64 or 128 compile only the kernels one model needs, which keeps NVRTC's
// time at start-up short; left undefined, every instantiation is compiled (as CI checks them).
#ifndef AIENG_DTYPE
#define AIENG_DTYPE 0
#endif
#ifndef AIENG_INT8
#define AIENG_INT8 (-1)
#endif
#ifndef AIENG_HEAD_DIM
#define AIENG_HEAD_DIM 0
#endif
#define AIENG_WANTS(DTYPE, INT8, HEAD_DIM)                                                  \
  ((AIENG_DTYPE == 0 || AIENG_DTYPE == (DTYPE)) && (AIENG_INT8 < 0 || AIENG_INT8 == (INT8)) && \
   (AIENG_HEAD_DIM == 0 || AIENG_HEAD_DIM == (HEAD_DIM)))

// ---- INT4 dequantization (int4_gemv.cu): two nibbles per instruction ------------------------
// A nibble q OR-ed into the low mantissa bits of a 16-bit float "magic" M gives the float M + q
// exactly (float16: M = 1024, ulp 1; bfloat16: M = 128, ulp 1), so one lop3 turns the nibbles at
// bits 0-3 and 16-19 of a word into two 16-bit floats, and one fma removes M (and the zero point)
// exactly. float16 also takes the nibbles at bits 4-7 / 20-23 without a shift: 1024 + 16q, scaled
// by 1/16 in the same fma. (FasterTransformer's and Marlin's trick; bfloat16's 7-bit mantissa has
// no room for the second position, so it shifts.)

// (a & b) | c in one instruction.
__device__ __forceinline__ u32 and_or(u32 a, u32 b, u32 c) {
#ifdef __CUDA_ARCH__
  u32 r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
#else
  return (a & b) | c;
#endif
}

// Bytes of (b:a) picked by the four selector nibbles of `select` (prmt.b32, default mode).
__device__ __forceinline__ u32 permute_bytes(u32 a, u32 b, u32 select) {
#ifdef __CUDA_ARCH__
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(select));
  return r;
#else
  const unsigned long long bytes = a | (static_cast<unsigned long long>(b) << 32);
  u32 r = 0;
  for (int i = 0; i < 4; ++i) {
    const unsigned pick = (select >> (4 * i)) & 0xFu;
    unsigned byte = (bytes >> (8 * (pick & 7u))) & 0xFFu;
    if (pick & 8u) byte = (byte & 0x80u) ? 0xFFu : 0u;  // sign replication
    r |= byte << (8 * i);
  }
  return r;
#endif
}

// a * b + c on two packed 16-bit floats, rounded once (fma.rn.f16x2 / fma.rn.bf16x2, sm_80).
template <typename T>
__device__ __forceinline__ u32 fma2(u32 a, u32 b, u32 c);
#ifndef __CUDA_ARCH__
// Host stand-in: exact in double for the operands used here (products of 16-bit floats, sums
// of small integers), then rounded to nearest even.
template <typename T>
inline u32 host_fma2(u32 a, u32 b, u32 c) {
  const double lo = double(low_to_float(a, T{})) * low_to_float(b, T{}) + low_to_float(c, T{});
  const double hi = double(high_to_float(a, T{})) * high_to_float(b, T{}) + high_to_float(c, T{});
  return pack2<T>(static_cast<float>(lo), static_cast<float>(hi));
}
#endif
template <>
__device__ __forceinline__ u32 fma2<f16_t>(u32 a, u32 b, u32 c) {
#ifdef __CUDA_ARCH__
  u32 r;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
#else
  return host_fma2<f16_t>(a, b, c);
#endif
}
template <>
__device__ __forceinline__ u32 fma2<bf16_t>(u32 a, u32 b, u32 c) {
#ifdef __CUDA_ARCH__
  u32 r;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
#else
  return host_fma2<bf16_t>(a, b, c);
#endif
}

// One group's constants for `dequant8`, as packed pairs: -(M + zero), -(M/16 + zero) (float16's
// second nibble position), the scale, and the multipliers 1 and 1/16.
template <typename T>
struct Int4Group {
  u32 minus_magic_zero, minus_magic16_zero, scale;
};
template <typename T>
struct Int4Magic;
template <>
struct Int4Magic<f16_t> {
  static constexpr u32 kBits = 0x64006400u;  // 1024, 1024
  static constexpr float kValue = 1024.f;
  static constexpr u32 kOne = 0x3C003C00u, kSixteenth = 0x2C002C00u, kMinusZero = 0x80008000u;
};
template <>
struct Int4Magic<bf16_t> {
  static constexpr u32 kBits = 0x43004300u;  // 128, 128
  static constexpr float kValue = 128.f;
  static constexpr u32 kOne = 0x3F803F80u, kSixteenth = 0x3D803D80u, kMinusZero = 0x80008000u;
};

// scale_zero: the float16 (scale, zero) pair of aieng's INT4 layout. The zero point must be an
// integer with |zero| <= 128 (kernels/int4.py refuses others), so M + zero is exact in either type.
template <typename T>
__device__ __forceinline__ Int4Group<T> int4_group(u32 scale_zero);
template <>  // float16: the pair is already in T; broadcast and negate in half2 arithmetic
__device__ __forceinline__ Int4Group<f16_t> int4_group<f16_t>(u32 scale_zero) {
  const u32 zero = permute_bytes(scale_zero, scale_zero, 0x3232u);
  constexpr u32 kMinusOne = 0xBC00BC00u, kMinusMagic = 0xE400E400u, kMinusMagic16 = 0xD400D400u;
  return {fma2<f16_t>(zero, kMinusOne, kMinusMagic), fma2<f16_t>(zero, kMinusOne, kMinusMagic16),
          permute_bytes(scale_zero, scale_zero, 0x1010u)};
}
template <>  // bfloat16: through float32 (the float16 scale rounded once to bfloat16)
__device__ __forceinline__ Int4Group<bf16_t> int4_group<bf16_t>(u32 scale_zero) {
  using T = bf16_t;
  const float scale = low_to_float(scale_zero, f16_t{});
  const float zero = high_to_float(scale_zero, f16_t{});
  const float magic = Int4Magic<T>::kValue;
  return {pack2<T>(-(magic + zero), -(magic + zero)),
          pack2<T>(-(magic / 16 + zero), -(magic / 16 + zero)), pack2<T>(scale, scale)};
}

// Eight nibbles of one word (k = 0..7, k in bits 4k..4k+3) -> four pairs of q - zero in T,
// exact, paired as (0, 4), (1, 5), (2, 6), (3, 7): the order the lop3 gives; the activations are
// paired the same way (pair_activations), which the dot product allows.
template <typename T>
__device__ __forceinline__ void int4_minus_zero(u32 word, const Int4Group<T>& group,
                                                u32 (&out)[4]);
template <>
__device__ __forceinline__ void int4_minus_zero<f16_t>(u32 word, const Int4Group<f16_t>& group,
                                                       u32 (&out)[4]) {
  using Magic = Int4Magic<f16_t>;
  const u32 high = word >> 8;
  out[0] = fma2<f16_t>(and_or(word, 0x000F000Fu, Magic::kBits), Magic::kOne,
                       group.minus_magic_zero);
  out[1] = fma2<f16_t>(and_or(word, 0x00F000F0u, Magic::kBits), Magic::kSixteenth,
                       group.minus_magic16_zero);
  out[2] = fma2<f16_t>(and_or(high, 0x000F000Fu, Magic::kBits), Magic::kOne,
                       group.minus_magic_zero);
  out[3] = fma2<f16_t>(and_or(high, 0x00F000F0u, Magic::kBits), Magic::kSixteenth,
                       group.minus_magic16_zero);
}
template <>
__device__ __forceinline__ void int4_minus_zero<bf16_t>(u32 word, const Int4Group<bf16_t>& group,
                                                        u32 (&out)[4]) {
  using Magic = Int4Magic<bf16_t>;
#pragma unroll
  for (int i = 0; i < 4; ++i)
    out[i] = fma2<bf16_t>(and_or(word >> (4 * i), 0x000F000Fu, Magic::kBits), Magic::kOne,
                          group.minus_magic_zero);
}

// The same pairs dequantized: (q - zero) * scale, rounded once to T.
template <typename T>
__device__ __forceinline__ void dequant8(u32 word, const Int4Group<T>& group, u32 (&out)[4]) {
  int4_minus_zero<T>(word, group, out);
#pragma unroll
  for (int i = 0; i < 4; ++i) out[i] = fma2<T>(out[i], group.scale, Int4Magic<T>::kMinusZero);
}

// Eight consecutive 16-bit activations (one 16-byte load) paired as dequant8 pairs the weights.
__device__ __forceinline__ void pair_activations(const uint4& v, u32 (&out)[4]) {
  out[0] = permute_bytes(v.x, v.z, 0x5410u);
  out[1] = permute_bytes(v.x, v.z, 0x7632u);
  out[2] = permute_bytes(v.y, v.w, 0x5410u);
  out[3] = permute_bytes(v.y, v.w, 0x7632u);
}
