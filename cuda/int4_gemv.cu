// Fused INT4 dequantize + matrix-vector product for decode batches: y (M, N) = x (M, K) W^T for
// M <= 16 rows per launch tile, every packed weight byte read once per tile
// (python/aieng/kernels/int4.py holds the layout, the launch plan and the references; the
// reasoning against the memory roofline is in cuda/README.md).
//
// Layout (aieng's CUDA INT4 layout):
//   qweight    (N, K / 2) uint8, row-major: byte j of row n holds q[n, 2j] in its low nibble and
//              q[n, 2j + 1] in its high nibble, so a 32-bit word holds 8 consecutive k in order.
//   scale_zero (N, K / group_size, 2) float16: (scale, zero) of each group of each row.
//   w[n, k] = (q[n, k] - zero[n, g]) * scale[n, g], g = k >> group_shift; group_size a power of
//   two >= 32, so a 32-weight (16-byte) chunk lies in one group.
//
// Two kernels:
// - int4_gemv_{f16,bf16}_m{8,16}: tensor cores (mma.sync m16n8k16, f32 accumulation) for any
//   M <= 8 / <= 16, computing y^T = W x^T: W's 16 rows of a block are the MMA's A (16 x 16), x's
//   rows its B (16 x 8; two for m16), so no fragment is padding at M <= 8. The weights are
//   dequantized in registers straight into the A fragments, Marlin-style: two nibbles per lop3
//   and two weights per fma (common.cuh, dequant8). A lane (g = lane / 4, t = lane % 4) loads,
//   per 128-k block, 16 bytes of rows n0 + g and n0 + g + 8: k = k0 + 32 t + [0, 32), four
//   words; word i gives two k16 steps, whose fragments are its pairs (0,4),(1,5) and (2,6),(3,7).
//   The dot product does not care which physical k stands for which logical k of the MMA as
//   long as B uses the same map, so the lane loads the same 32 activations of x row g (and
//   g + 8) and pairs them with one prmt per pair: no shared memory, no float conversion of x,
//   each activation loaded once per CTA. The CTA's 8 warps
//   split K in 128-k blocks and add their fragments in shared memory; CTAs walk the row blocks
//   of 16 rows in a grid-stride loop over a grid sized from the SM count. Rows past N and M,
//   chunks past K: loads clamped to valid addresses (never predicated), a chunk past K given
//   weights 0 and zero point 0, results past N or M not stored.
// - int4_gemv_f32_m{1,2,4,8,16}: CUDA cores for float32 activations (no tensor-core type holds
//   them exactly). A thread owns one 16-byte chunk of ROWS rows per step; a nibble becomes the
//   float 1 + q/16 with a shift and one bit-or, and per chunk
//   sum((q - z) s x) = s * (16 * dot - (16 + z) * sum(x)), accumulated in float32.
#include "common.cuh"

namespace int4_gemv_detail {

constexpr int kChunk = 32;  // weights per 16-byte load

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

// ---------------------------------------------------------------- tensor cores (f16, bf16)

constexpr int kMmaWarps = 8;
constexpr int kMmaThreads = 32 * kMmaWarps;
constexpr int kTilesN = 2;                 // n8 tiles of W: the MMA's A rows g and g + 8
constexpr int kBlockRows = 8 * kTilesN;    // rows of W per CTA step
constexpr int kBlockK = 128;               // k per warp block: 4 lanes x 32
constexpr int kSteps = 2;                  // blocks whose loads a warp issues together

template <bool B>
struct Flag {
  static constexpr bool value = B;
};

template <typename T, bool ROWS16, bool SCALE_AFTER>
__device__ __forceinline__ void int4_gemv_mma(const T* __restrict__ x,
                                              const unsigned char* __restrict__ qweight,
                                              const unsigned* __restrict__ scale_zero,
                                              T* __restrict__ y, int M, int N, int K,
                                              int group_shift) {
  constexpr int kHalves = ROWS16 ? 2 : 1;  // n8 tiles of x rows (the MMA's B operands)
  __shared__ float partial[kMmaWarps][kHalves][4][32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, t = lane % 4;
  const int m0 = blockIdx.y * 8 * kHalves;
  const int chunks = K / kChunk, groups = ((K - 1) >> group_shift) + 1;
  const T* x_rows[kHalves];
#pragma unroll
  for (int h = 0; h < kHalves; ++h)
    x_rows[h] = x + static_cast<size_t>(min(m0 + 8 * h + g, M - 1)) * K;
  const int row_blocks = (N + kBlockRows - 1) / kBlockRows;

  for (int block = blockIdx.x; block < row_blocks; block += gridDim.x) {
    const int n0 = block * kBlockRows;
    const unsigned char* rows[kTilesN];
    const unsigned* groups_of[kTilesN];
#pragma unroll
    for (int j = 0; j < kTilesN; ++j) {  // W rows g and g + 8 of the block: A's two halves
      const int n = min(n0 + 8 * j + g, N - 1);
      rows[j] = qweight + static_cast<size_t>(n) * (K / 2);
      groups_of[j] = scale_zero + static_cast<size_t>(n) * groups;
    }
    float acc[kHalves][4];
#pragma unroll
    for (int h = 0; h < kHalves; ++h)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[h][e] = 0.f;

    // Each step: kSteps 128-k blocks of this warp, all their weight and scale loads issued
    // before any math (the bytes in flight, README), then block by block the activations and
    // the MMAs.
    auto step = [&](int k0, auto masked) {
      uint4 w[kSteps][kTilesN];
      u32 sz[kSteps][kTilesN];
      int chunk[kSteps];
#pragma unroll
      for (int u = 0; u < kSteps; ++u) {
        const int wanted = (k0 + u * kMmaWarps * kBlockK) / kChunk + t;
        chunk[u] = min(wanted, chunks - 1);  // clamped: a chunk past K is loaded, unused
        // A chunk past K: weights 0 and zero point 0, so A = 0; the scale stays the row's (a
        // 128-k block partly past K lies in the row's last group, whose scale SCALE_AFTER uses).
        const u32 keep = !decltype(masked)::value || wanted < chunks ? 0xFFFFFFFFu : 0u;
#pragma unroll
        for (int j = 0; j < kTilesN; ++j) {
          const uint4 v = load_streaming(rows[j] + chunk[u] * (kChunk / 2));
          w[u][j] = make_uint4(v.x & keep, v.y & keep, v.z & keep, v.w & keep);
          sz[u][j] = groups_of[j][(chunk[u] * kChunk) >> group_shift] & (keep | 0xFFFFu);
        }
      }
#pragma unroll
      for (int u = 0; u < kSteps; ++u) {
        uint4 xv[kHalves][4];
#pragma unroll
        for (int h = 0; h < kHalves; ++h)
#pragma unroll
          for (int i = 0; i < 4; ++i)
            xv[h][i] = *reinterpret_cast<const uint4*>(x_rows[h] + chunk[u] * kChunk + 8 * i);
        const Int4Group<T> low = int4_group<T>(sz[u][0]), high = int4_group<T>(sz[u][1]);
        const u32 words[2][4] = {{w[u][0].x, w[u][0].y, w[u][0].z, w[u][0].w},
                                 {w[u][1].x, w[u][1].y, w[u][1].z, w[u][1].w}};
        // SCALE_AFTER (groups >= 128: the block is one group): A = q - z exactly, the block's
        // sums scaled in float32 by the rows' scales; else A = (q - z) * s in T.
        float block_sum[kHalves][4];
#pragma unroll
        for (int h = 0; h < kHalves; ++h)
#pragma unroll
          for (int e = 0; e < 4; ++e) block_sum[h][e] = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          u32 wl[4], wh[4], xp[kHalves][4];
          if (SCALE_AFTER) {
            int4_minus_zero<T>(words[0][i], low, wl);
            int4_minus_zero<T>(words[1][i], high, wh);
          } else {
            dequant8<T>(words[0][i], low, wl);
            dequant8<T>(words[1][i], high, wh);
          }
#pragma unroll
          for (int h = 0; h < kHalves; ++h) pair_activations(xv[h][i], xp[h]);
#pragma unroll
          for (int s = 0; s < 2; ++s) {
            const u32 a[4] = {wl[2 * s], wh[2 * s], wl[2 * s + 1], wh[2 * s + 1]};
#pragma unroll
            for (int h = 0; h < kHalves; ++h) {
              const u32 b[2] = {xp[h][2 * s], xp[h][2 * s + 1]};
              mma_16816<T>(SCALE_AFTER ? block_sum[h] : acc[h], a, b);
            }
          }
        }
        if (SCALE_AFTER) {  // fragment rows: W rows g (e = 0, 1) and g + 8 (e = 2, 3)
          const float scale[2] = {low_to_float(sz[u][0], f16_t{}),
                                  low_to_float(sz[u][1], f16_t{})};
#pragma unroll
          for (int h = 0; h < kHalves; ++h)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[h][e] = fmaf(scale[e / 2], block_sum[h][e], acc[h][e]);
        }
      }
    };
    // Steps wholly inside K without the masks, then at most one step that reaches past K.
    const int stride = kSteps * kMmaWarps * kBlockK, reach = stride - (kMmaWarps - 1) * kBlockK;
    int k0 = warp * kBlockK;
    for (; k0 + reach <= K; k0 += stride) step(k0, Flag<false>{});
    if (k0 < K) step(k0, Flag<true>{});

    // The warps' partial sums into y: fragment element e of half h at lane l is y^T row
    // n0 + l / 4 + 8 (e / 2), column m0 + 8 h + 2 (l % 4) + e % 2.
#pragma unroll
    for (int h = 0; h < kHalves; ++h)
#pragma unroll
      for (int e = 0; e < 4; ++e) partial[warp][h][e][lane] = acc[h][e];
    __syncthreads();
    if (threadIdx.x < kHalves * 128) {
      const int h = threadIdx.x / 128, e = (threadIdx.x / 32) % 4, l = threadIdx.x % 32;
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kMmaWarps; ++w) sum += partial[w][h][e][l];
      const int m = m0 + 8 * h + 2 * (l % 4) + e % 2;
      const int n = n0 + l / 4 + 8 * (e / 2);
      if (m < M && n < N) y[static_cast<size_t>(m) * N + n] = from_float<T>(sum);
    }
    __syncthreads();
  }
}

// ---------------------------------------------------------------- CUDA cores (float32)

constexpr int kThreads = 128;

// Nibble i of a word as the float 1 + q/16: q moved to mantissa bits 19..22 under exponent 0.
__device__ __forceinline__ float nibble_as_float(unsigned word, int i) {
  const int shift = 19 - 4 * i;
  const unsigned moved = shift >= 0 ? word << shift : word >> -shift;
  return __uint_as_float((moved & 0x00780000u) | 0x3F800000u);
}

template <int M_TILE, int ROWS>
__device__ __forceinline__ void int4_gemv_f32(const float* __restrict__ x,
                                              const unsigned char* __restrict__ qweight,
                                              const unsigned* __restrict__ scale_zero,
                                              float* __restrict__ y, int M, int N, int K,
                                              int group_shift) {
  const int chunks = K / kChunk;
  const int groups = ((K - 1) >> group_shift) + 1;  // K itself: one group
  const int row0 = (blockIdx.x * blockDim.y + threadIdx.y) * ROWS;
  const int m0 = blockIdx.y * M_TILE;
  const float* x_rows[M_TILE];
#pragma unroll
  for (int m = 0; m < M_TILE; ++m) x_rows[m] = x + static_cast<size_t>(min(m0 + m, M - 1)) * K;
  const unsigned char* rows[ROWS];
  const unsigned* groups_of[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {  // clamped: a row past N is read and not stored
    const int n = min(row0 + r, N - 1);
    rows[r] = qweight + static_cast<size_t>(n) * (K / 2);
    groups_of[r] = scale_zero + static_cast<size_t>(n) * groups;
  }

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
      w[r] = load_streaming(rows[r] + c * (kChunk / 2));
      const unsigned sz = groups_of[r][(c * kChunk) >> group_shift];
      scale[r] = low_to_float(sz, f16_t{});
      zero[r] = high_to_float(sz, f16_t{});
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
    for (int i = 0; i < warps_per_group; ++i)
      sum += partial[threadIdx.y * warps_per_group + i][threadIdx.x];
    if (m0 + m < M && n < N) y[static_cast<size_t>(m0 + m) * N + n] = sum;
  }
}

}  // namespace int4_gemv_detail

// int4_gemv_<dtype>_m<M_TILE>[_g128]: up to M_TILE rows of x per launch tile (blockIdx.y);
// _g128 for groups of 128 or more (or one per row), whose scales are applied after the MMA.
#define AIENG_INT4_GEMV_MMA(NAME, T, M_TILE, MIN_BLOCKS, SUFFIX, SCALE_AFTER)                    \
  extern "C" __global__ void __launch_bounds__(int4_gemv_detail::kMmaThreads, MIN_BLOCKS)        \
      int4_gemv_##NAME##_m##M_TILE##SUFFIX(const T* __restrict__ x,                              \
                                           const unsigned char* __restrict__ q,                  \
                                           const unsigned* __restrict__ sz, T* __restrict__ y,   \
                                           int M, int N, int K, int group_shift) {               \
    int4_gemv_detail::int4_gemv_mma<T, (M_TILE > 8), SCALE_AFTER>(x, q, sz, y, M, N, K,         \
                                                                   group_shift);                 \
  }
#define AIENG_INT4_GEMV_MMA_GROUPS(NAME, T, M_TILE, MIN_BLOCKS) \
  AIENG_INT4_GEMV_MMA(NAME, T, M_TILE, MIN_BLOCKS, , false)     \
  AIENG_INT4_GEMV_MMA(NAME, T, M_TILE, MIN_BLOCKS, _g128, true)

// ROWS output rows per thread (fewer for large tiles, whose accumulators would not fit).
#define AIENG_INT4_GEMV_F32(M_TILE, ROWS)                                                       \
  extern "C" __global__ void __launch_bounds__(int4_gemv_detail::kThreads)                      \
      int4_gemv_f32_m##M_TILE(const float* __restrict__ x, const unsigned char* __restrict__ q, \
                              const unsigned* __restrict__ sz, float* __restrict__ y, int M,    \
                              int N, int K, int group_shift) {                                  \
    int4_gemv_detail::int4_gemv_f32<M_TILE, ROWS>(x, q, sz, y, M, N, K, group_shift);           \
  }

AIENG_INT4_GEMV_MMA_GROUPS(f16, f16_t, 8, 2)
AIENG_INT4_GEMV_MMA_GROUPS(f16, f16_t, 16, 2)
AIENG_INT4_GEMV_MMA_GROUPS(bf16, bf16_t, 8, 2)
AIENG_INT4_GEMV_MMA_GROUPS(bf16, bf16_t, 16, 2)
AIENG_INT4_GEMV_F32(1, 4)
AIENG_INT4_GEMV_F32(2, 2)
AIENG_INT4_GEMV_F32(4, 2)
AIENG_INT4_GEMV_F32(8, 1)
AIENG_INT4_GEMV_F32(16, 1)
