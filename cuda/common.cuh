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
