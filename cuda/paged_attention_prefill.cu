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
// BN = 32 token steps, K and V gathered through the block table into a two-stage shared buffer
// (positions past the tile's last clamped to it, so every load is valid; masked in the math):
// a cache in T with cp.async, the next step's copies in flight while this step is computed; an
// INT8 cache through registers, every chunk's int8 values and scales loaded before the first is
// dequantized to T (rounded as the reference rounds) and stored. S = Q K^T by MMA in float32
// with K's B fragments read by ldmatrix, online softmax per row in registers (a row's four
// threads agree through two shuffles), then O += P V by MMA with P re-packed from S's
// accumulator fragments into A fragments. V's B fragments are read as 16-bit pairs: with
// ldmatrix.trans ptxas hoisted all of a step's V fragments (228-244 registers on sm_90 against
// 168, spilling under a 3-CTA bound), see cuda/README.md.
#include "async_copy.cuh"
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
  constexpr int kStage = kBN * kStride;
  constexpr int kChunks = kBN * (D / 8) / kThreads;  // 8-element chunks of K (or V) per thread
  static_assert(kBN * (D / 8) % kThreads == 0, "a step's chunks divide among the threads");
  __shared__ __align__(16) unsigned short k_s[2 * kStage];
  __shared__ __align__(16) unsigned short v_s[2 * kStage];
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

  // Chunk i of this thread in the step at n0: position n0 + j (clamped to hi - 1), dims d.
  auto chunk = [&](int n0, int i, int& j, int& d) -> long long {
    const int c = tid + i * kThreads;
    j = c / (D / 8), d = (c % (D / 8)) * 8;
    const int pos = min(n0 + j, hi - 1);
    const int slot = table[pos >> block_shift] * (block_mask + 1) + (pos & block_mask);
    return static_cast<long long>(slot) * num_kv_heads + kv_head;  // (slot, KV head)
  };
  // A cache in T: the step's K and V copied as they are into stage s.
  auto copy_step = [&](int n0, int s) {
    long long token_head[kChunks];
    int j[kChunks], d[kChunks];
#pragma unroll
    for (int i = 0; i < kChunks; ++i) token_head[i] = chunk(n0, i, j[i], d[i]);
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      cp_async<16>(&k_s[s * kStage + j[i] * kStride + d[i]], k_cache + token_head[i] * D + d[i]);
      cp_async<16>(&v_s[s * kStage + j[i] * kStride + d[i]], v_cache + token_head[i] * D + d[i]);
    }
  };
  // An INT8 cache: the step's values and scales into registers, then dequantized into stage s.
  uint2 k_raw[kChunks], v_raw[kChunks];
  T k_mul[kChunks], v_mul[kChunks];
  auto load_step = [&](int n0) {
    int j, d;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const long long token_head = chunk(n0, i, j, d);
      k_raw[i] = *reinterpret_cast<const uint2*>(k_cache + token_head * D + d);
      v_raw[i] = *reinterpret_cast<const uint2*>(v_cache + token_head * D + d);
      k_mul[i] = k_scale[token_head];
      v_mul[i] = v_scale[token_head];
    }
  };
  auto store_step = [&](int s) {
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int c = tid + i * kThreads, j = c / (D / 8), d = (c % (D / 8)) * 8;
      float kf[8], vf[8];
      load8(reinterpret_cast<const signed char*>(&k_raw[i]), kf);
      load8(reinterpret_cast<const signed char*>(&v_raw[i]), vf);
      const float ks = to_float(k_mul[i]), vs = to_float(v_mul[i]);
      u32 k_bits[4], v_bits[4];
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        k_bits[w] = pack2<T>(kf[2 * w] * ks, kf[2 * w + 1] * ks);
        v_bits[w] = pack2<T>(vf[2 * w] * vs, vf[2 * w + 1] * vs);
      }
      *reinterpret_cast<uint4*>(&k_s[s * kStage + j * kStride + d]) =
          uint4{k_bits[0], k_bits[1], k_bits[2], k_bits[3]};
      *reinterpret_cast<uint4*>(&v_s[s * kStage + j * kStride + d]) =
          uint4{v_bits[0], v_bits[1], v_bits[2], v_bits[3]};
    }
  };

  if constexpr (!kQuantized) {
    copy_step(lo, 0);  // (lo < hi: the tile's first query attends at least its own position)
    cp_async_commit();
  }
  for (int n0 = lo, s = 0; n0 < hi; n0 += kBN, s ^= 1) {
    __syncthreads();  // the previous step is computed: its stage may be refilled
    if constexpr (kQuantized) {
      load_step(n0);  // every chunk's loads issued before the first is converted
      store_step(s);
    } else {
      if (n0 + kBN < hi) copy_step(n0 + kBN, s ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    }
    __syncthreads();  // this step's K and V are in stage s
    const unsigned short* ks = &k_s[s * kStage];
    const unsigned short* vs = &v_s[s * kStage];
    // This lane's row address for ldmatrix: row lane % 8 of matrix lane / 8.
    const int mat = lane / 8, mat_row = lane % 8;

    // S = Q K^T: s[nt] is the 16 x 8 block of positions n0 + 8 nt ...; ldmatrix gives the B
    // fragments of dims [16 kk, 16 kk + 32) (two k steps) for 8 positions.
    float sc[kBN / 8][4];
#pragma unroll
    for (int nt = 0; nt < kBN / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[nt][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; kk += 2) {
        u32 b[4];
        ldmatrix_x4<false>(b, &ks[(nt * 8 + mat_row) * kStride + kk * 16 + mat * 8]);
        const u32 b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        mma_16816<T>(sc[nt], qa[kk], b0);
        mma_16816<T>(sc[nt], qa[kk + 1], b1);
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
        sc[nt][e] = ok ? sc[nt][e] * scale_log2 : AIENG_NEG_INF;
        tile_max[e / 2] = fmaxf(tile_max[e / 2], sc[nt][e]);
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
          sc[nt][e] = exp2f(sc[nt][e] - base);
          row_sum[i] += sc[nt][e];
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
      const u32 pa[4] = {pack2<T>(sc[2 * kk][0], sc[2 * kk][1]),
                         pack2<T>(sc[2 * kk][2], sc[2 * kk][3]),
                         pack2<T>(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                         pack2<T>(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
      const unsigned short* v0 = &vs[(kk * 16 + 2 * t) * kStride];
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
