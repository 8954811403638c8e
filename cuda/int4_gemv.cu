// Fused INT4 dequantize + matrix-vector product for decode batches: y (M, N) = x (M, K) W^T,
// M <= 16 rows per launch tile, every packed weight byte read once (python/aieng/kernels/int4.py
// holds the layout, the launch parameters and the pure-PyTorch reference of this math).
//
// Layout (aieng's CUDA INT4 layout):
//   qweight    (N, K / 2) uint8, row-major: byte j of row n holds q[n, 2j] in its low nibble and
//              q[n, 2j + 1] in its high nibble, so a 32-bit word holds 8 consecutive k in order.
//   scale_zero (N, K / group_size, 2) float16: (scale, zero) of each group of each row.
//   w[n, k] = (q[n, k] - zero[n, g]) * scale[n, g], g = k / group_size; group_size % 32 == 0.
//
// A thread owns one 16-byte chunk (32 consecutive k, inside one group) of ROWS rows per step;
// the threadIdx.x of a row group walk K in chunks, lanes reading consecutive 16 bytes
// (coalesced 128-bit loads). A nibble becomes the float 1 + q/16 with a shift and one bit-or
// (exponent bits of 1.0, q in the top of the mantissa), so the dot product is taken without an
// int-to-float conversion: sum((1 + q/16) x) = sum(x) + sum(q x) / 16, hence per chunk
//   sum((q - z) s x) = s * (16 * dot - (16 + z) * sum(x)),
// accumulated in float32. The threads of a row group then reduce with warp shuffles and shared
// memory. Grid: (ceil(N / (ROWS * blockDim.y)), ceil(M / M_TILE)); block (tx, 128 / tx).
#include "dtype_convert.cuh"

namespace {

constexpr int kThreads = 128;
constexpr int kChunk = 32;  // weights per 16-byte load

// Nibble i of a word as the float 1 + q/16: q moved to mantissa bits 19..22 under exponent 0.
__device__ __forceinline__ float nibble_as_float(unsigned word, int i) {
  const int shift = 19 - 4 * i;
  const unsigned moved = shift >= 0 ? word << shift : word >> -shift;
  return __uint_as_float((moved & 0x00780000u) | 0x3F800000u);
}

__device__ __forceinline__ uint4 load_streaming(const unsigned char* p) {
#ifdef __CUDA_ARCH__
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
#else
  return *reinterpret_cast<const uint4*>(p);
#endif
}

template <typename T, int M_TILE, int ROWS>
__device__ __forceinline__ void int4_gemv(const T* __restrict__ x,
                                          const unsigned char* __restrict__ qweight,
                                          const unsigned* __restrict__ scale_zero,
                                          T* __restrict__ y, int M, int N, int K, int group_size) {
  const int chunks = K / kChunk;
  const int groups = K / group_size;
  const int row0 = (blockIdx.x * blockDim.y + threadIdx.y) * ROWS;
  const int m0 = blockIdx.y * M_TILE;
  const T* x_rows[M_TILE];
#pragma unroll
  for (int m = 0; m < M_TILE; ++m) x_rows[m] = x + static_cast<size_t>(min(m0 + m, M - 1)) * K;

  float total[M_TILE][ROWS];
#pragma unroll
  for (int m = 0; m < M_TILE; ++m)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) total[m][r] = 0.f;

  for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
    uint4 w[ROWS];
    float scale[ROWS], zero[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int n = row0 + r;
      if (n < N) {
        w[r] = load_streaming(qweight + static_cast<size_t>(n) * (K / 2) + c * (kChunk / 2));
        const unsigned sz = scale_zero[static_cast<size_t>(n) * groups + c * kChunk / group_size];
        scale[r] = low_to_float(sz, f16_t{});
        zero[r] = high_to_float(sz, f16_t{});
      } else {
        w[r] = make_uint4(0u, 0u, 0u, 0u);
        scale[r] = 0.f;
        zero[r] = 0.f;
      }
    }
    float dot[M_TILE][ROWS];
    float xsum[M_TILE];
#pragma unroll
    for (int m = 0; m < M_TILE; ++m) {
      xsum[m] = 0.f;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) dot[m][r] = 0.f;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // the chunk's four words, 8 weights each
      float wf[ROWS][8];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const unsigned word = j == 0 ? w[r].x : j == 1 ? w[r].y : j == 2 ? w[r].z : w[r].w;
#pragma unroll
        for (int i = 0; i < 8; ++i) wf[r][i] = nibble_as_float(word, i);
      }
#pragma unroll
      for (int m = 0; m < M_TILE; ++m) {
        float xf[8];
        load8(x_rows[m] + c * kChunk + 8 * j, xf);
#pragma unroll
        for (int i = 0; i < 8; ++i) xsum[m] += xf[i];
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
          for (int i = 0; i < 8; ++i) dot[m][r] = fmaf(wf[r][i], xf[i], dot[m][r]);
      }
    }
#pragma unroll
    for (int m = 0; m < M_TILE; ++m)
#pragma unroll
      for (int r = 0; r < ROWS; ++r)
        total[m][r] += scale[r] * (16.f * dot[m][r] - (16.f + zero[r]) * xsum[m]);
  }

  // Reduce over the row group's threads: shuffles in each warp, then its warps in shared memory.
  __shared__ float partial[kThreads / 32][M_TILE * ROWS];
  const int lane = threadIdx.x % 32;
  const int warps_per_group = blockDim.x / 32;
  const int warp = threadIdx.y * warps_per_group + threadIdx.x / 32;
#pragma unroll
  for (int m = 0; m < M_TILE; ++m)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const float v = warp_sum(total[m][r]);
      if (lane == 0) partial[warp][m * ROWS + r] = v;
    }
  __syncthreads();
  if (threadIdx.x < M_TILE * ROWS) {
    const int m = threadIdx.x / ROWS, r = threadIdx.x % ROWS;
    const int n = row0 + r;
    float sum = 0.f;
    for (int i = 0; i < warps_per_group; ++i) sum += partial[threadIdx.y * warps_per_group + i][threadIdx.x];
    if (m0 + m < M && n < N) y[static_cast<size_t>(m0 + m) * N + n] = from_float<T>(sum);
  }
}

}  // namespace

// int4_gemv_<dtype>_m<M_TILE>: M_TILE rows of x per launch tile; ROWS output rows per thread
// (fewer for large tiles, whose accumulators would not fit in registers).
#define AIENG_INT4_GEMV(NAME, T, M_TILE, ROWS)                                                   \
  extern "C" __global__ void __launch_bounds__(kThreads)                                         \
      int4_gemv_##NAME##_m##M_TILE(const T* __restrict__ x, const unsigned char* __restrict__ q, \
                                   const unsigned* __restrict__ sz, T* __restrict__ y, int M,    \
                                   int N, int K, int group_size) {                               \
    int4_gemv<T, M_TILE, ROWS>(x, q, sz, y, M, N, K, group_size);                                \
  }

#define AIENG_INT4_GEMV_TILES(NAME, T) \
  AIENG_INT4_GEMV(NAME, T, 1, 4)       \
  AIENG_INT4_GEMV(NAME, T, 2, 2)       \
  AIENG_INT4_GEMV(NAME, T, 4, 2)       \
  AIENG_INT4_GEMV(NAME, T, 8, 1)       \
  AIENG_INT4_GEMV(NAME, T, 16, 1)

AIENG_INT4_GEMV_TILES(f16, f16_t)
AIENG_INT4_GEMV_TILES(bf16, bf16_t)
AIENG_INT4_GEMV_TILES(f32, float)
