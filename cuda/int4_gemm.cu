// Fused INT4 dequantize + matrix product on tensor cores for prefill: y (M, N) = x (M, K) W^T,
// float16 or bfloat16 x and y, float32 accumulation (python/aieng/kernels/int4.py holds the
// layout, the launch parameters and the pure-PyTorch reference).
//
// Layout (as int4_gemv.cu): qweight (N, K / 2) uint8, byte j of row n = q[n, 2j] | q[n, 2j+1] << 4;
// scale_zero (N, K >> group_shift, 2) float16 (scale, zero); w = (q - zero) * scale; K % 32 == 0
// and the group size a power of two >= 32 (or one group per row), so a 32-wide k tile lies in
// one group, found by shift.
//
// A block of 128 threads computes a 64 x 64 tile of y. Per k tile of 32: the x tile (64 x 32) is
// copied to shared memory with 128-bit loads; each thread reads 8 packed bytes (16 weights of
// one row), dequantizes them in float32 and stores them in x's dtype to shared memory as the
// (n, k) tile of W, i.e. the column-major k x n operand. Each of the 4 warps then multiplies a
// 32 x 32 sub-tile with mma.sync m16n8k16 (2 x 4 tiles, 2 k steps). Rows past M and N read zeros
// and are not stored. Grid: (ceil(N / 64), ceil(M / 64)).
#include "common.cuh"

namespace {

constexpr int kBlockM = 64;
constexpr int kBlockN = 64;
constexpr int kBlockK = 32;
constexpr int kPad = 8;  // halves of padding per shared row: conflict-free fragment reads
constexpr int kStride = kBlockK + kPad;

__device__ __forceinline__ unsigned shared_word(const unsigned short* tile, int row, int col) {
  return *reinterpret_cast<const unsigned*>(tile + row * kStride + col);
}

template <typename T>
__device__ __forceinline__ void int4_gemm(const T* __restrict__ x,
                                          const unsigned char* __restrict__ qweight,
                                          const unsigned* __restrict__ scale_zero,
                                          T* __restrict__ y, int M, int N, int K, int group_shift) {
  __shared__ __align__(16) unsigned short x_tile[kBlockM * kStride];
  __shared__ __align__(16) unsigned short w_tile[kBlockN * kStride];
  const int m0 = blockIdx.y * kBlockM, n0 = blockIdx.x * kBlockN;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int group = lane / 4, quad = lane % 4;  // the mma fragment coordinates
  const int warp_m = (warp / 2) * 32, warp_n = (warp % 2) * 32;
  const int groups = ((K - 1) >> group_shift) + 1;  // K itself: one group

  float acc[2][4][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

  // The weights this thread dequantizes: row n0 + tid / 2, k half (tid % 2) of each k tile.
  const int w_row = tid / 2, w_half = tid % 2;
  const int wn = n0 + w_row;

  for (int k0 = 0; k0 < K; k0 += kBlockK) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {  // x tile: 64 rows x 4 pieces of 8 elements
      const int piece = tid + i * 128;
      const int row = piece / 4, col = (piece % 4) * 8;
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (m0 + row < M)
        v = *reinterpret_cast<const uint4*>(x + static_cast<size_t>(m0 + row) * K + k0 + col);
      *reinterpret_cast<uint4*>(x_tile + row * kStride + col) = v;
    }
    {
      uint2 packed = make_uint2(0u, 0u);
      float scale = 0.f, zero = 0.f;
      if (wn < N) {
        packed = *reinterpret_cast<const uint2*>(qweight + static_cast<size_t>(wn) * (K / 2) +
                                                 k0 / 2 + w_half * 8);
        const unsigned sz = scale_zero[static_cast<size_t>(wn) * groups + (k0 >> group_shift)];
        scale = low_to_float(sz, f16_t{});
        zero = high_to_float(sz, f16_t{});
      }
      u32 out[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const unsigned word = i < 4 ? packed.x : packed.y;
        const int shift = 8 * (i % 4);
        const float lo = (static_cast<float>((word >> shift) & 0xFu) - zero) * scale;
        const float hi = (static_cast<float>((word >> (shift + 4)) & 0xFu) - zero) * scale;
        out[i] = pack2<T>(lo, hi);
      }
      uint4* dst = reinterpret_cast<uint4*>(w_tile + w_row * kStride + w_half * 16);
      dst[0] = make_uint4(out[0], out[1], out[2], out[3]);
      dst[1] = make_uint4(out[4], out[5], out[6], out[7]);
    }
    __syncthreads();
#pragma unroll
    for (int ks = 0; ks < kBlockK; ks += 16) {
      u32 a[2][4], b[4][2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int row = warp_m + i * 16 + group;
        a[i][0] = shared_word(x_tile, row, ks + 2 * quad);
        a[i][1] = shared_word(x_tile, row + 8, ks + 2 * quad);
        a[i][2] = shared_word(x_tile, row, ks + 2 * quad + 8);
        a[i][3] = shared_word(x_tile, row + 8, ks + 2 * quad + 8);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int col = warp_n + j * 8 + group;
        b[j][0] = shared_word(w_tile, col, ks + 2 * quad);
        b[j][1] = shared_word(w_tile, col, ks + 2 * quad + 8);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) mma_16816<T>(acc[i][j], a[i], b[j]);
    }
    __syncthreads();
  }

#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int m = m0 + warp_m + i * 16 + group + (e / 2) * 8;
        const int n = n0 + warp_n + j * 8 + 2 * quad + e % 2;
        if (m < M && n < N) y[static_cast<size_t>(m) * N + n] = from_float<T>(acc[i][j][e]);
      }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(128, 2)
    int4_gemm_f16(const f16_t* __restrict__ x, const unsigned char* __restrict__ q,
                  const unsigned* __restrict__ sz, f16_t* __restrict__ y, int M, int N, int K,
                  int group_shift) {
  int4_gemm<f16_t>(x, q, sz, y, M, N, K, group_shift);
}

extern "C" __global__ void __launch_bounds__(128, 2)
    int4_gemm_bf16(const bf16_t* __restrict__ x, const unsigned char* __restrict__ q,
                   const unsigned* __restrict__ sz, bf16_t* __restrict__ y, int M, int N, int K,
                   int group_shift) {
  int4_gemm<bf16_t>(x, q, sz, y, M, N, K, group_shift);
}
