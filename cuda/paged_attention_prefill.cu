// Paged prefill / chunked-prefill attention on tensor cores: the query tokens of requests with
// more than one new token, over their cached context (the new tokens' K/V already written to the
// cache), causal with the cached-prefix offset, optional sliding window (the reference is
// paged_attention in python/aieng/attention/torch_paged.py; cuda_paged.py launches this).
//
// Cache layout as in paged_attention_decode.cu. Query i of request r (its tokens are rows
// query_start[r] + i of q and out) sits at position num_computed[r] + i and attends to positions
// p with p <= its own and, with a window, p > its own - window.
//
// Grid (query tiles, num_heads), 128 threads: a tile is BM = 64 queries of one request (the
// host lists each tile's request and first query), one query head. Each warp owns 16 queries;
// Q stays in registers as mma.m16n8k16 A fragments. The CTA walks the tile's positions in
// BN = 32 token steps: K and V gathered through the block table into shared memory (an INT8
// cache dequantized on the way, rounded to T as the reference does), S = Q K^T by MMA in float32,
// online softmax per row in registers (a row's four threads agree through two shuffles), then
// O += P V by MMA with P re-packed from S's accumulator fragments into A fragments.
#include "common.cuh"

// Named (not anonymous), so that the host emulation can build every source in one program.
namespace paged_prefill {

constexpr int kThreads = 128;
constexpr int kBM = 64;  // queries per CTA (16 per warp)
constexpr int kBN = 32;  // positions per step
constexpr float kLog2e = 1.4426950408889634f;

template <typename T, typename C, int D>
__device__ __forceinline__ void prefill_attention(
    T* __restrict__ out, const T* __restrict__ q, int q_stride, const C* __restrict__ k_cache,
    const C* __restrict__ v_cache, const T* __restrict__ k_scale, const T* __restrict__ v_scale,
    const int* __restrict__ block_tables, int table_stride, const int* __restrict__ query_start,
    const int* __restrict__ num_computed, const int* __restrict__ seq_lens,
    const int* __restrict__ tile_request, const int* __restrict__ tile_first, int num_heads,
    int num_kv_heads, int block_shift, int window, float scale) {
  constexpr bool kQuantized = sizeof(C) == 1;
  constexpr int kStride = D + 8;  // 16-bit elements per shared row (padding against conflicts)
  __shared__ __align__(16) unsigned short k_s[kBN * kStride];
  __shared__ __align__(16) unsigned short v_s[kBN * kStride];

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int r = tile_request[blockIdx.x], first = tile_first[blockIdx.x];
  const int head = blockIdx.y, kv_head = head / (num_heads / num_kv_heads);
  const int q_begin = query_start[r], q_len = query_start[r + 1] - q_begin;
  const int computed = num_computed[r];
  const int* table = block_tables + static_cast<long long>(r) * table_stride;
  const int block_mask = (1 << block_shift) - 1;
  const float scale_log2 = scale * kLog2e;

  // This thread's two query rows (g and g + 8 of the warp's 16) and their positions.
  const int row0 = first + warp * 16 + g, row1 = row0 + 8;
  const int pos0 = computed + row0, pos1 = computed + row1;
  const int last_row = min(first + kBM, q_len) - 1;
  const int lo = window > 0 ? max(0, computed + first - window + 1) : 0;
  const int hi = computed + last_row + 1;  // positions [lo, hi) may be attended by the tile

  // Q as A fragments: qa[kk] covers dims [16 kk, 16 kk + 16).
  u32 qa[D / 16][4];
  const u32* q0 = reinterpret_cast<const u32*>(
      q + static_cast<long long>(q_begin + min(row0, q_len - 1)) * q_stride + head * D);
  const u32* q1 = reinterpret_cast<const u32*>(
      q + static_cast<long long>(q_begin + min(row1, q_len - 1)) * q_stride + head * D);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    qa[kk][0] = row0 < q_len ? q0[kk * 8 + t] : 0u;
    qa[kk][1] = row1 < q_len ? q1[kk * 8 + t] : 0u;
    qa[kk][2] = row0 < q_len ? q0[kk * 8 + 4 + t] : 0u;
    qa[kk][3] = row1 < q_len ? q1[kk * 8 + 4 + t] : 0u;
  }

  float o[D / 8][4];
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[dt][e] = 0.f;
  float row_max[2] = {AIENG_NEG_INF, AIENG_NEG_INF};
  float row_sum[2] = {0.f, 0.f};  // this thread's part of each row's sum

  for (int n0 = lo; n0 < hi; n0 += kBN) {
    __syncthreads();  // the previous step's K/V are no longer read
    // Gather K and V of positions [n0, n0 + kBN) into shared memory as T.
    for (int c = tid; c < kBN * (D / 8); c += kThreads) {
      const int j = c / (D / 8), d = (c % (D / 8)) * 8;
      const int pos = n0 + j;
      uint4 k_bits = {0u, 0u, 0u, 0u}, v_bits = {0u, 0u, 0u, 0u};
      if (pos < hi) {
        const int slot = table[pos >> block_shift] * (block_mask + 1) + (pos & block_mask);
        const long long token_head = static_cast<long long>(slot) * num_kv_heads + kv_head;
        if constexpr (kQuantized) {
          float kf[8], vf[8];
          load8(k_cache + token_head * D + d, kf);
          load8(v_cache + token_head * D + d, vf);
          const float ks = to_float(k_scale[token_head]), vs = to_float(v_scale[token_head]);
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            kf[i] *= ks;
            vf[i] *= vs;
          }
          k_bits = uint4{pack2<T>(kf[0], kf[1]), pack2<T>(kf[2], kf[3]),
                         pack2<T>(kf[4], kf[5]), pack2<T>(kf[6], kf[7])};
          v_bits = uint4{pack2<T>(vf[0], vf[1]), pack2<T>(vf[2], vf[3]),
                         pack2<T>(vf[4], vf[5]), pack2<T>(vf[6], vf[7])};
        } else {  // already T: the 16 bytes as they are
          k_bits = *reinterpret_cast<const uint4*>(k_cache + token_head * D + d);
          v_bits = *reinterpret_cast<const uint4*>(v_cache + token_head * D + d);
        }
      }
      *reinterpret_cast<uint4*>(&k_s[j * kStride + d]) = k_bits;
      *reinterpret_cast<uint4*>(&v_s[j * kStride + d]) = v_bits;
    }
    __syncthreads();

    // S = Q K^T: s[nt] is the 16 x 8 block of positions n0 + 8 nt ...
    float s[kBN / 8][4];
#pragma unroll
    for (int nt = 0; nt < kBN / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;
      const unsigned short* k_row = &k_s[(nt * 8 + g) * kStride];
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const u32 b[2] = {*reinterpret_cast<const u32*>(&k_row[kk * 16 + 2 * t]),
                          *reinterpret_cast<const u32*>(&k_row[kk * 16 + 8 + 2 * t])};
        mma_16816<T>(s[nt], qa[kk], b);
      }
    }
    // Mask, scale, online softmax (rows: e < 2 -> row0, else row1).
    float tile_max[2] = {AIENG_NEG_INF, AIENG_NEG_INF};
#pragma unroll
    for (int nt = 0; nt < kBN / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int pos_q = e < 2 ? pos0 : pos1;
        const bool row_ok = (e < 2 ? row0 : row1) < q_len;
        const int pos_k = n0 + nt * 8 + 2 * t + (e & 1);
        const bool ok = row_ok && pos_k < hi && pos_k <= pos_q &&
                        (window <= 0 || pos_k > pos_q - window);
        s[nt][e] = ok ? s[nt][e] * scale_log2 : AIENG_NEG_INF;
        tile_max[e / 2] = fmaxf(tile_max[e / 2], s[nt][e]);
      }
    float alpha[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 1));
      tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 2));
      const float new_max = fmaxf(row_max[i], tile_max[i]);
      // a row with nothing attended yet keeps max -inf; subtract 0 so that 2^(-inf) = 0
      const float base = new_max == AIENG_NEG_INF ? 0.f : new_max;
      alpha[i] = exp2f(row_max[i] - base);
      row_max[i] = new_max;
      row_sum[i] *= alpha[i];
#pragma unroll
      for (int nt = 0; nt < kBN / 8; ++nt)
#pragma unroll
        for (int e = 2 * i; e < 2 * i + 2; ++e) {
          s[nt][e] = exp2f(s[nt][e] - base);
          row_sum[i] += s[nt][e];
        }
    }
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      o[dt][0] *= alpha[0];
      o[dt][1] *= alpha[0];
      o[dt][2] *= alpha[1];
      o[dt][3] *= alpha[1];
    }
    // O += P V: P's accumulator fragments of positions [16 kk, 16 kk + 16) are an A fragment.
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) {
      const u32 pa[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]),
                         pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                         pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                         pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
      const unsigned short* v0 = &v_s[(kk * 16 + 2 * t) * kStride];
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        const int col = dt * 8 + g;
        const u32 b[2] = {
            static_cast<u32>(v0[col]) | (static_cast<u32>(v0[kStride + col]) << 16),
            static_cast<u32>(v0[8 * kStride + col]) |
                (static_cast<u32>(v0[9 * kStride + col]) << 16)};
        mma_16816<T>(o[dt], pa, b);
      }
    }
  }

  // Each row's sum over its four threads, then O / sum.
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 1);
    row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 2);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = i == 0 ? row0 : row1;
    if (row >= q_len) continue;
    const float inv = 1.f / row_sum[i];
    u32* dst = reinterpret_cast<u32*>(out + (static_cast<long long>(q_begin + row) * num_heads +
                                             head) * D);
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
      dst[dt * 4 + t] = pack2<T>(o[dt][2 * i] * inv, o[dt][2 * i + 1] * inv);
  }
}

}  // namespace paged_prefill

#define AIENG_PREFILL(NAME, T, C, D)                                                              \
  extern "C" __global__ void __launch_bounds__(paged_prefill::kThreads) NAME(                     \
      T* out, const T* q, int q_stride, const C* k_cache, const C* v_cache, const T* k_scale,     \
      const T* v_scale, const int* block_tables, int table_stride, const int* query_start,        \
      const int* num_computed, const int* seq_lens, const int* tile_request,                      \
      const int* tile_first, int num_heads, int num_kv_heads, int block_shift, int window,        \
      float scale) {                                                                              \
    paged_prefill::prefill_attention<T, C, D>(                                                    \
        out, q, q_stride, k_cache, v_cache, k_scale, v_scale, block_tables, table_stride,         \
        query_start, num_computed, seq_lens, tile_request, tile_first, num_heads, num_kv_heads,   \
        block_shift, window, scale);                                                              \
  }

// paged_prefill_<dtype>_<cache: kv = dtype, i8 = int8>_d<head_dim>
#if AIENG_WANTS(1, 0, 64)
AIENG_PREFILL(paged_prefill_f16_kv_d64, f16_t, f16_t, 64)
#endif
#if AIENG_WANTS(1, 0, 128)
AIENG_PREFILL(paged_prefill_f16_kv_d128, f16_t, f16_t, 128)
#endif
#if AIENG_WANTS(1, 1, 64)
AIENG_PREFILL(paged_prefill_f16_i8_d64, f16_t, signed char, 64)
#endif
#if AIENG_WANTS(1, 1, 128)
AIENG_PREFILL(paged_prefill_f16_i8_d128, f16_t, signed char, 128)
#endif
#if AIENG_WANTS(2, 0, 64)
AIENG_PREFILL(paged_prefill_bf16_kv_d64, bf16_t, bf16_t, 64)
#endif
#if AIENG_WANTS(2, 0, 128)
AIENG_PREFILL(paged_prefill_bf16_kv_d128, bf16_t, bf16_t, 128)
#endif
#if AIENG_WANTS(2, 1, 64)
AIENG_PREFILL(paged_prefill_bf16_i8_d64, bf16_t, signed char, 64)
#endif
#if AIENG_WANTS(2, 1, 128)
AIENG_PREFILL(paged_prefill_bf16_i8_d128, bf16_t, signed char, 128)
#endif
