// Element types and conversions for aieng's kernels, without the CUDA toolkit's headers (NVRTC
// gets only aieng's own): float16 and bfloat16 are held as their 16 bits and converted with one
// PTX instruction each (round to nearest even, as torch's casts do). Without __CUDA_ARCH__ (the
// host emulation of tests/cuda_host/emulate.h) the conversions are its C++ stand-ins.
#pragma once

struct f16_t {
  unsigned short bits;
};
struct bf16_t {
  unsigned short bits;
};

__device__ __forceinline__ float to_float(float v) { return v; }

__device__ __forceinline__ float to_float(f16_t v) {
#ifdef __CUDA_ARCH__
  float out;
  asm("cvt.f32.f16 %0, %1;" : "=f"(out) : "h"(v.bits));
  return out;
#else
  return host_half_to_float(v.bits);
#endif
}

__device__ __forceinline__ float to_float(bf16_t v) {
  return __uint_as_float(static_cast<unsigned>(v.bits) << 16);
}

template <typename T>
__device__ __forceinline__ T from_float(float v);

template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}

template <>
__device__ __forceinline__ f16_t from_float<f16_t>(float v) {
  f16_t out;
#ifdef __CUDA_ARCH__
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(out.bits) : "f"(v));
#else
  out.bits = host_float_to_half(v);
#endif
  return out;
}

template <>
__device__ __forceinline__ bf16_t from_float<bf16_t>(float v) {
  bf16_t out;
#ifdef __CUDA_ARCH__
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(out.bits) : "f"(v));
#else
  out.bits = host_float_to_bf16(v);
#endif
  return out;
}

// The low and high 16 bits of a 32-bit word as floats (two packed f16 or bf16 values).
__device__ __forceinline__ float low_to_float(unsigned word, f16_t) {
  return to_float(f16_t{static_cast<unsigned short>(word & 0xFFFFu)});
}
__device__ __forceinline__ float high_to_float(unsigned word, f16_t) {
  return to_float(f16_t{static_cast<unsigned short>(word >> 16)});
}
__device__ __forceinline__ float low_to_float(unsigned word, bf16_t) {
  return __uint_as_float(word << 16);
}
__device__ __forceinline__ float high_to_float(unsigned word, bf16_t) {
  return __uint_as_float(word & 0xFFFF0000u);
}

// Eight consecutive elements (16-byte aligned) as floats: one 128-bit load for 16-bit types,
// two for float.
__device__ __forceinline__ void load8(const float* p, float out[8]) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
  out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}

template <typename T>
__device__ __forceinline__ void load8(const T* p, float out[8]) {
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  const unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = low_to_float(words[i], T{});
    out[2 * i + 1] = high_to_float(words[i], T{});
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
  return v;
}
