// Paged decode attention: one query token per request over its cached context, read through
// the request's block table (python/aieng/attention/cuda_paged.py launches it; the reference is
// paged_attention in python/aieng/attention/torch_paged.py; cuda/README.md gives the design's
// bandwidth arithmetic).
//
// Cache layout (one layer): K and V (num_blocks, block_size, num_kv_heads, D) in the model's
// dtype T, or int8 with one scale per token per KV head, (num_blocks, block_size, num_kv_heads)
// in T (value = q * scale, dequantized here in registers). Token position t of request r lives
// in block block_tables[r][t / block_size] at offset t % block_size (block_size a power of two).
//
// Grid (num_kv_heads * head_chunks, R, num_splits), 128 threads. A CTA owns one KV head, up to
// HG query heads of its GQA group (so each KV head's context is read once per group of up to 8
// query heads), and one split of the context (flash-decoding: the positions
// [start + s * split_tokens, start + (s + 1) * split_tokens) with start the sliding window's
// first position). It walks its split in tiles of TILE tokens, online softmax in float32:
//   0. loads: each thread copies its kPasses tokens' 8 dims of K and V (16 bytes each, 8 for
//      int8) with cp.async into its own slots of a two-stage shared buffer, positions clamped
//      into the split so that every load is valid and none waits on another or on a branch; the
//      next tile's copies are issued before this tile is waited for (two tiles in flight), the
//      block-table entries one tile further ahead, an INT8 cache's scales with the copies;
//   1. scores: LPT lanes per token, 8 dims per lane from its slots, shuffle-reduced; positions
//      past the split (the clamped duplicates) get score -inf, so weight 0;
//   2. per head: tile max, p = 2^(s - m), running max / sum rescaled;
//   3. acc[h][8 dims] += p * v, each thread over its own tokens;
// then the threads' partial sums are added in shared memory. With one split the CTA writes the
// normalized output; with several it writes the unnormalized sum and (max, sum) per split, and
// paged_decode_reduce_* combines them: out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.
#include "async_copy.cuh"
#include "common.cuh"

// Named (not anonymous), so that the host emulation can build every source in one program.
namespace paged_decode {

constexpr int kThreads = 128;
constexpr int kPasses = 4;  // tokens per thread per tile
// At least four CTAs per SM, with a tile of 16 KB in flight each: 64 KB per SM, twice what
// Little's law asks of HBM3e (cuda/README.md). Asked of ptxas for g8 only (116-168 registers
// unbounded); g1-g4 fit 5-8 unbounded, and an explicit minimum raises ptxas's choice for them.
constexpr int kMinCtasPerSm = 4;
constexpr float kLog2e = 1.4426950408889634f;

template <int D>
struct DecodeShape {
  static constexpr int kLanesPerToken = D / 8;                    // 8 dims per lane
  static constexpr int kTokenGroups = kThreads / kLanesPerToken;  // tokens per pass
  static constexpr int kTile = kTokenGroups * kPasses;            // tokens per tile
};

// Eight cache elements (one lane's dims of one token): 16 bytes of a 16-bit type, 8 of int8.
template <typename C>
struct Chunk {
  using type = uint4;
};
template <>
struct Chunk<signed char> {
  using type = uint2;
};

// A buffer stage as a type, so that the tile loop's two stages index registers and shared
// memory with constants.
template <int S>
struct Stage {
  static constexpr int value = S;
};

template <typename T, typename C, int D, int HG>
__device__ __forceinline__ void decode_attention(
    T* __restrict__ out, float* __restrict__ part_acc, float* __restrict__ part_ml,
    const T* __restrict__ q, int q_stride, const C* __restrict__ k_cache,
    const C* __restrict__ v_cache, const T* __restrict__ k_scale, const T* __restrict__ v_scale,
    const int* __restrict__ block_tables, int table_stride, const int* __restrict__ seq_lens,
    const int* __restrict__ rows, int num_heads, int num_kv_heads, int group, int head_chunks,
    int block_shift, int window, float scale, int split_tokens) {
  using Shape = DecodeShape<D>;
  using Bits = typename Chunk<C>::type;
  constexpr int LPT = Shape::kLanesPerToken;
  constexpr int NG = Shape::kTokenGroups;
  constexpr int TILE = Shape::kTile;
  constexpr bool kQuantized = sizeof(C) == 1;
  // The K/V stages during the loop, the token groups' partial sums after it: one buffer.
  constexpr int kStageBytes = 2 * kPasses * kThreads * static_cast<int>(sizeof(Bits));  // K, V
  constexpr int kReduceBytes = NG * HG * D * static_cast<int>(sizeof(float));
  constexpr int kPoolBytes = 2 * kStageBytes > kReduceBytes ? 2 * kStageBytes : kReduceBytes;

  __shared__ float q_s[HG][D];
  __shared__ float score_s[HG][TILE];
  __shared__ float max_s[HG], sum_s[HG], alpha_s[HG];
  __shared__ __align__(16) unsigned char pool[kPoolBytes];
  // [stage][K = 0, V = 1][pass][thread]: a thread reads back only what it copied itself
  auto kv_s = reinterpret_cast<Bits(*)[2][kPasses][kThreads]>(pool);
  auto reduce_s = reinterpret_cast<float(*)[HG][D]>(pool);

  const int tid = threadIdx.x;
  const int kv_head = blockIdx.x / head_chunks;
  const int first_head = kv_head * group + (blockIdx.x % head_chunks) * HG;
  const int heads = min(HG, kv_head * group + group - first_head);
  const int r = blockIdx.y, split = blockIdx.z, num_splits = gridDim.z;
  const int seq_len = seq_lens[r];
  const int start = window > 0 ? max(0, seq_len - window) : 0;
  const int begin = start + split * split_tokens;
  const int end = min(seq_len, begin + split_tokens);
  const int row = rows[r];
  if (begin >= end) {  // the reduction counts only the splits that hold tokens
    if (num_splits == 1) {  // an empty context (a padding row): zeros rather than garbage
      for (int i = tid; i < heads * D; i += kThreads)
        out[(static_cast<long long>(row) * num_heads + first_head) * D + i] = from_float<T>(0.f);
    }
    return;
  }
  const int* table = block_tables + static_cast<long long>(r) * table_stride;
  const int block_mask = (1 << block_shift) - 1;
  const int lane_d = (tid % LPT) * 8;  // this thread's 8 dims
  const int token_group = tid / LPT;

  // This thread's token of pass p in the tile at `tile`, clamped into the split.
  auto position = [&](int tile, int p) { return min(tile + p * NG + token_group, end - 1); };
  int blocks[kPasses];  // block-table entries of the next tile to copy
  auto load_blocks = [&](int tile) {
#pragma unroll
    for (int p = 0; p < kPasses; ++p) blocks[p] = table[position(tile, p) >> block_shift];
  };
  T scales[2][2][kPasses];  // [stage][K, V][pass]: an INT8 cache's scales, loaded with the copy
  auto copy_tile = [&](auto stage, int tile) {
    constexpr int s = decltype(stage)::value;
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      const long long slot =
          (static_cast<long long>(blocks[p]) << block_shift) | (position(tile, p) & block_mask);
      const long long token_head = slot * num_kv_heads + kv_head;
      cp_async<sizeof(Bits)>(&kv_s[s][0][p][tid], k_cache + token_head * D + lane_d);
      cp_async<sizeof(Bits)>(&kv_s[s][1][p][tid], v_cache + token_head * D + lane_d);
      if constexpr (kQuantized) {
        scales[s][0][p] = k_scale[token_head];
        scales[s][1][p] = v_scale[token_head];
      }
    }
  };

  // q of the CTA's heads, scaled so that exp2 of a score is the softmax numerator.
  for (int i = tid; i < HG * D; i += kThreads) {
    const int h = i / D, d = i % D;
    const float value = h < heads ? to_float(q[static_cast<long long>(row) * q_stride +
                                              (first_head + h) * D + d])
                                  : 0.f;
    q_s[h][d] = value * scale * kLog2e;
  }
  if (tid < HG) {
    max_s[tid] = AIENG_NEG_INF;
    sum_s[tid] = 0.f;
  }

  float acc[HG][8];
#pragma unroll
  for (int h = 0; h < HG; ++h)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[h][i] = 0.f;

  // One tile, held in stage s: the next tile's copies go out, then this one's are waited for.
  auto attend_tile = [&](auto stage, int tile) {
    constexpr int s = decltype(stage)::value;
    if (tile + TILE < end) copy_tile(Stage<1 - s>{}, tile + TILE);
    cp_async_commit();  // (an empty group after the last tile keeps the count uniform)
    load_blocks(tile + 2 * TILE);
    cp_async_wait<1>();
    float k_mul[kPasses], v_mul[kPasses];
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      k_mul[p] = kQuantized ? to_float(scales[s][0][p]) : 1.f;
      v_mul[p] = kQuantized ? to_float(scales[s][1][p]) : 1.f;
    }
    __syncthreads();  // q_s written / the previous tile's scores read
    // 1. scores of this thread's kPasses tokens, for every head
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      float kf[8];
      load8(reinterpret_cast<const C*>(&kv_s[s][0][p][tid]), kf);
      const bool inside = tile + p * NG + token_group < end;
#pragma unroll
      for (int h = 0; h < HG; ++h) {
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) dot += q_s[h][lane_d + i] * kf[i];
#pragma unroll
        for (int lanes = LPT / 2; lanes > 0; lanes >>= 1)
          dot += __shfl_xor_sync(0xffffffffu, dot, lanes);
        if (tid % LPT == 0)
          score_s[h][p * NG + token_group] = inside ? dot * k_mul[p] : AIENG_NEG_INF;
      }
    }
    __syncthreads();
    // 2. online softmax, one warp per head
    for (int h = tid / 32; h < HG; h += kThreads / 32) {
      float tile_max = AIENG_NEG_INF;
      for (int j = tid % 32; j < TILE; j += 32) tile_max = fmaxf(tile_max, score_s[h][j]);
      const float old_max = max_s[h];
      const float new_max = fmaxf(old_max, warp_max(tile_max));
      float tile_sum = 0.f;
      for (int j = tid % 32; j < TILE; j += 32) {
        const float p = exp2f(score_s[h][j] - new_max);
        score_s[h][j] = p;
        tile_sum += p;
      }
      tile_sum = warp_sum(tile_sum);
      if (tid % 32 == 0) {
        const float alpha = exp2f(old_max - new_max);
        alpha_s[h] = alpha;
        sum_s[h] = sum_s[h] * alpha + tile_sum;
        max_s[h] = new_max;
      }
    }
    __syncthreads();
    // 3. acc = acc * alpha + p V (a masked position's p is 0, its clamped V finite)
#pragma unroll
    for (int h = 0; h < HG; ++h) {
      const float alpha = alpha_s[h];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[h][i] *= alpha;
    }
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      float vf[8];
      load8(reinterpret_cast<const C*>(&kv_s[s][1][p][tid]), vf);
#pragma unroll
      for (int h = 0; h < HG; ++h) {
        const float weight = score_s[h][p * NG + token_group] * v_mul[p];
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[h][i] += weight * vf[i];
      }
    }
  };

  load_blocks(begin);
  copy_tile(Stage<0>{}, begin);
  cp_async_commit();
  load_blocks(begin + TILE);
  for (int tile = begin; tile < end; tile += 2 * TILE) {
    attend_tile(Stage<0>{}, tile);
    if (tile + TILE < end) attend_tile(Stage<1>{}, tile + TILE);
  }
  cp_async_wait<0>();
  __syncthreads();  // every thread done with the stages: the pool now holds the partial sums

  // The token groups' partial sums, added up.
#pragma unroll
  for (int h = 0; h < HG; ++h)
#pragma unroll
    for (int i = 0; i < 8; ++i) reduce_s[token_group][h][lane_d + i] = acc[h][i];
  __syncthreads();
  for (int i = tid; i < heads * D; i += kThreads) {
    const int h = i / D, d = i % D;
    float total = 0.f;
#pragma unroll
    for (int g = 0; g < NG; ++g) total += reduce_s[g][h][d];
    const int head = first_head + h;
    if (num_splits == 1) {
      out[(static_cast<long long>(row) * num_heads + head) * D + d] =
          from_float<T>(total / sum_s[h]);
    } else {
      const long long part = (static_cast<long long>(r) * num_heads + head) * num_splits + split;
      part_acc[part * D + d] = total;
      if (d == 0) {
        part_ml[2 * part] = max_s[h];
        part_ml[2 * part + 1] = sum_s[h];
      }
    }
  }
}

// Grid (num_heads, R), D threads: the splits of one (request, head) combined.
template <typename T>
__device__ __forceinline__ void decode_reduce(T* __restrict__ out,
                                              const float* __restrict__ part_acc,
                                              const float* __restrict__ part_ml,
                                              const int* __restrict__ seq_lens,
                                              const int* __restrict__ rows, int num_splits,
                                              int window, int split_tokens) {
  const int head = blockIdx.x, num_heads = gridDim.x, r = blockIdx.y, d = threadIdx.x;
  const int D = blockDim.x;
  const int seq_len = seq_lens[r];
  const int start = window > 0 ? max(0, seq_len - window) : 0;
  const int used = ceil_div(seq_len - start, split_tokens);
  const long long at = (static_cast<long long>(rows[r]) * num_heads + head) * D + d;
  if (used == 0) {  // an empty context (a padding row)
    out[at] = from_float<T>(0.f);
    return;
  }
  const long long first = (static_cast<long long>(r) * num_heads + head) * num_splits;
  float global_max = AIENG_NEG_INF;
  for (int s = 0; s < used; ++s) global_max = fmaxf(global_max, part_ml[2 * (first + s)]);
  float numerator = 0.f, denominator = 0.f;
  for (int s = 0; s < used; ++s) {
    const float weight = exp2f(part_ml[2 * (first + s)] - global_max);
    numerator += weight * part_acc[(first + s) * D + d];
    denominator += weight * part_ml[2 * (first + s) + 1];
  }
  out[at] = from_float<T>(numerator / denominator);
}

}  // namespace paged_decode

#define AIENG_DECODE(NAME, T, C, D, HG, ...)                                                      \
  extern "C" __global__ void __launch_bounds__(__VA_ARGS__) NAME(                                 \
      T* out, float* part_acc, float* part_ml, const T* q, int q_stride, const C* k_cache,        \
      const C* v_cache, const T* k_scale, const T* v_scale, const int* block_tables,              \
      int table_stride, const int* seq_lens, const int* rows, int num_heads, int num_kv_heads,    \
      int group, int head_chunks, int block_shift, int window, float scale, int split_tokens) {   \
    paged_decode::decode_attention<T, C, D, HG>(                                                  \
        out, part_acc, part_ml, q, q_stride, k_cache, v_cache, k_scale, v_scale, block_tables,    \
        table_stride, seq_lens, rows, num_heads, num_kv_heads, group, head_chunks, block_shift,   \
        window, scale, split_tokens);                                                             \
  }

// paged_decode_<dtype>_<cache: kv = dtype, i8 = int8>_d<head_dim>_g<query heads per CTA>
#define AIENG_DECODE_GROUPS(DT, T, KV, C, D)                                                      \
  AIENG_DECODE(paged_decode_##DT##_##KV##_d##D##_g1, T, C, D, 1, paged_decode::kThreads)          \
  AIENG_DECODE(paged_decode_##DT##_##KV##_d##D##_g2, T, C, D, 2, paged_decode::kThreads)          \
  AIENG_DECODE(paged_decode_##DT##_##KV##_d##D##_g4, T, C, D, 4, paged_decode::kThreads)          \
  AIENG_DECODE(paged_decode_##DT##_##KV##_d##D##_g8, T, C, D, 8, paged_decode::kThreads,          \
               paged_decode::kMinCtasPerSm)

#if AIENG_WANTS(1, 0, 64)
AIENG_DECODE_GROUPS(f16, f16_t, kv, f16_t, 64)
#endif
#if AIENG_WANTS(1, 0, 128)
AIENG_DECODE_GROUPS(f16, f16_t, kv, f16_t, 128)
#endif
#if AIENG_WANTS(1, 1, 64)
AIENG_DECODE_GROUPS(f16, f16_t, i8, signed char, 64)
#endif
#if AIENG_WANTS(1, 1, 128)
AIENG_DECODE_GROUPS(f16, f16_t, i8, signed char, 128)
#endif
#if AIENG_WANTS(2, 0, 64)
AIENG_DECODE_GROUPS(bf16, bf16_t, kv, bf16_t, 64)
#endif
#if AIENG_WANTS(2, 0, 128)
AIENG_DECODE_GROUPS(bf16, bf16_t, kv, bf16_t, 128)
#endif
#if AIENG_WANTS(2, 1, 64)
AIENG_DECODE_GROUPS(bf16, bf16_t, i8, signed char, 64)
#endif
#if AIENG_WANTS(2, 1, 128)
AIENG_DECODE_GROUPS(bf16, bf16_t, i8, signed char, 128)
#endif

#define AIENG_DECODE_REDUCE(NAME, T)                                                              \
  extern "C" __global__ void __launch_bounds__(256)                                               \
      NAME(T* out, const float* part_acc, const float* part_ml, const int* seq_lens,              \
           const int* rows, int num_splits, int window, int split_tokens) {                       \
    paged_decode::decode_reduce<T>(out, part_acc, part_ml, seq_lens, rows, num_splits, window,    \
                                   split_tokens);                                                 \
  }

#if AIENG_WANTS(1, AIENG_INT8, AIENG_HEAD_DIM)
AIENG_DECODE_REDUCE(paged_decode_reduce_f16, f16_t)
#endif
#if AIENG_WANTS(2, AIENG_INT8, AIENG_HEAD_DIM)
AIENG_DECODE_REDUCE(paged_decode_reduce_bf16, bf16_t)
#endif
