// Fused element-wise kernels around attention and the MLP, each one pass over its tensors
// instead of torch's several (python/aieng/kernels/fused.py holds the launches and the
// pure-PyTorch references these reproduce, rounding step for rounding step):
//   add_rms_norm   residual add + RMSNorm (aieng.layers.norm.rms_norm)
//   rope_kv_write  neox RoPE on q and k + writing k and v into the paged KV cache, optionally
//                  quantizing them to INT8 with a scale per token and KV head
//                  (aieng.layers.rotary.apply_rotary, attention.torch_paged.write_kv_cache /
//                  write_quantized_kv_cache)
//   silu_and_mul   silu(gate) * up (aieng.layers.activation.silu_and_mul)
#include "dtype_convert.cuh"

namespace {

constexpr int kNormThreads = 256;

// One block per row of x (T, H): x += branch (rounded to T, as torch adds), then
// out = weight * rms_norm(x), the weight applied to the normalised value cast to T (Llama) or in
// float32 before the cast (OLMo 2, weight_in_float32). branch may be null (a plain RMSNorm).
template <typename T>
__device__ void add_rms_norm(T* __restrict__ x, const T* __restrict__ branch,
                             const T* __restrict__ weight, T* __restrict__ out, int hidden,
                             float eps, int weight_in_float32) {
  T* row = x + static_cast<size_t>(blockIdx.x) * hidden;
  const T* add = branch == nullptr ? nullptr : branch + static_cast<size_t>(blockIdx.x) * hidden;
  float sum_sq = 0.f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    float v = to_float(row[i]);
    if (add != nullptr) {
      const T sum = from_float<T>(v + to_float(add[i]));
      row[i] = sum;
      v = to_float(sum);
    }
    sum_sq = fmaf(v, v, sum_sq);
  }
  __shared__ float partial[kNormThreads / 32];
  sum_sq = warp_sum(sum_sq);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = sum_sq;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) total += partial[w];
  const float inv_rms = rsqrtf(total / hidden + eps);
  T* dst = out + static_cast<size_t>(blockIdx.x) * hidden;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float normed = to_float(row[i]) * inv_rms;
    const float w = to_float(weight[i]);
    dst[i] = from_float<T>(weight_in_float32 ? w * normed : w * to_float(from_float<T>(normed)));
  }
}

// A head vector of D = 2 * half values held by one warp as pairs (i, i + half), up to
// kMaxPairs per lane (D <= 256).
constexpr int kMaxPairs = 4;

template <typename T>
struct HeadPairs {
  float lo[kMaxPairs], hi[kMaxPairs];

  __device__ void load(const T* head, int half) {
#pragma unroll
    for (int p = 0; p < kMaxPairs; ++p) {
      const int i = threadIdx.x + 32 * p;
      lo[p] = i < half ? to_float(head[i]) : 0.f;
      hi[p] = i < half ? to_float(head[i + half]) : 0.f;
    }
  }

  // x1 * cos - x2 * sin, x2 * cos + x1 * sin, each product and sum rounded (as torch's separate
  // element-wise ops), then rounded to T.
  __device__ void rotate(const float* cos_row, const float* sin_row, int half) {
#pragma unroll
    for (int p = 0; p < kMaxPairs; ++p) {
      const int i = threadIdx.x + 32 * p;
      if (i < half) {
        const float c = cos_row[i], s = sin_row[i];
        const float a = __fsub_rn(__fmul_rn(lo[p], c), __fmul_rn(hi[p], s));
        const float b = __fadd_rn(__fmul_rn(hi[p], c), __fmul_rn(lo[p], s));
        lo[p] = to_float(from_float<T>(a));
        hi[p] = to_float(from_float<T>(b));
      }
    }
  }

  __device__ void store(T* head, int half) const {
#pragma unroll
    for (int p = 0; p < kMaxPairs; ++p) {
      const int i = threadIdx.x + 32 * p;
      if (i < half) {
        head[i] = from_float<T>(lo[p]);
        head[i + half] = from_float<T>(hi[p]);
      }
    }
  }

  // Symmetric INT8 with one scale for the vector: max|x| / 127 (at least `tiny`), rounded to
  // T as the cache stores it; q = round_half_even(x / scale) in [-127, 127].
  __device__ void store_int8(signed char* head, T* scale_slot, int half, float tiny) const {
    float amax = 0.f;
#pragma unroll
    for (int p = 0; p < kMaxPairs; ++p) amax = fmaxf(amax, fmaxf(fabsf(lo[p]), fabsf(hi[p])));
    amax = warp_max(amax);
    const T scale_t = from_float<T>(fmaxf(amax / 127.f, tiny));
    const float scale = to_float(scale_t);
    if (threadIdx.x == 0) *scale_slot = scale_t;
#pragma unroll
    for (int p = 0; p < kMaxPairs; ++p) {
      const int i = threadIdx.x + 32 * p;
      if (i < half) {
        head[i] = static_cast<signed char>(fminf(fmaxf(rintf(lo[p] / scale), -127.f), 127.f));
        head[i + half] =
            static_cast<signed char>(fminf(fmaxf(rintf(hi[p] / scale), -127.f), 127.f));
      }
    }
  }
};

// Grid (T, H + 2 * H_kv), one warp per block: head y < H rotates q[t, y] in place; the next
// H_kv rotate k[t, .] in place and write it to the cache; the last H_kv write v. Token rows of
// q, k, v are `*_stride` elements apart (views of one fused qkv projection); heads are
// contiguous. The cache is (slots, H_kv, D) in T, or int8 with scales (slots, H_kv) in T when
// k_scale is not null. A negative slot writes nothing (a padded row).
template <typename T>
__device__ void rope_kv_write(T* q, T* k, const T* v, int q_stride, int k_stride, int v_stride,
                              const long long* positions, const long long* slots,
                              const float* cos, const float* sin, int rotate, void* k_cache,
                              void* v_cache, T* k_scale, T* v_scale, int num_heads,
                              int num_kv_heads, int head_dim, float tiny) {
  const int t = blockIdx.x, y = blockIdx.y, half = head_dim / 2;
  const bool is_q = y < num_heads, is_k = !is_q && y < num_heads + num_kv_heads;
  const int h = is_q ? y : is_k ? y - num_heads : y - num_heads - num_kv_heads;
  HeadPairs<T> pairs;
  T* head = is_q   ? q + static_cast<size_t>(t) * q_stride + h * head_dim
            : is_k ? k + static_cast<size_t>(t) * k_stride + h * head_dim
                   : nullptr;
  pairs.load(head != nullptr ? head : v + static_cast<size_t>(t) * v_stride + h * head_dim, half);
  if (head != nullptr && rotate) {
    const size_t position = static_cast<size_t>(positions[t]);
    pairs.rotate(cos + position * half, sin + position * half, half);
    pairs.store(head, half);
  }
  const long long slot = slots[t];
  if (is_q || slot < 0) return;
  const size_t offset = (static_cast<size_t>(slot) * num_kv_heads + h) * head_dim;
  void* cache = is_k ? k_cache : v_cache;
  if (k_scale == nullptr) {
    pairs.store(static_cast<T*>(cache) + offset, half);
  } else {
    T* scale_slot = (is_k ? k_scale : v_scale) + static_cast<size_t>(slot) * num_kv_heads + h;
    pairs.store_int8(static_cast<signed char*>(cache) + offset, scale_slot, half, tiny);
  }
}

// x (T, 2I) = [gate | up] -> out (T, I) = silu(gate) * up: silu in float32 rounded to T, then
// the product rounded to T (torch's two ops). Grid-stride over T * I elements.
template <typename T>
__device__ void silu_and_mul(const T* __restrict__ x, T* __restrict__ out, long long rows,
                             int inter) {
  const long long total = rows * inter;
  for (long long e = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long r = e / inter, i = e % inter;
    const float g = to_float(x[r * 2 * inter + i]);
    const float u = to_float(x[r * 2 * inter + inter + i]);
    const float silu = to_float(from_float<T>(g / (1.f + expf(-g))));
    out[e] = from_float<T>(silu * u);
  }
}

}  // namespace

#define AIENG_FUSED_OPS(NAME, T)                                                                 \
  extern "C" __global__ void __launch_bounds__(kNormThreads)                                     \
      add_rms_norm_##NAME(T* x, const T* branch, const T* weight, T* out, int hidden, float eps, \
                          int weight_in_float32) {                                               \
    add_rms_norm<T>(x, branch, weight, out, hidden, eps, weight_in_float32);                     \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(32) rope_kv_write_##NAME(                         \
      T* q, T* k, const T* v, int q_stride, int k_stride, int v_stride,                          \
      const long long* positions, const long long* slots, const float* cos, const float* sin,    \
      int rotate, void* k_cache, void* v_cache, T* k_scale, T* v_scale, int num_heads,           \
      int num_kv_heads, int head_dim, float tiny) {                                              \
    rope_kv_write<T>(q, k, v, q_stride, k_stride, v_stride, positions, slots, cos, sin, rotate,  \
                     k_cache, v_cache, k_scale, v_scale, num_heads, num_kv_heads, head_dim,      \
                     tiny);                                                                      \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(256)                                              \
      silu_and_mul_##NAME(const T* x, T* out, long long rows, int inter) {                       \
    silu_and_mul<T>(x, out, rows, inter);                                                        \
  }

AIENG_FUSED_OPS(f16, f16_t)
AIENG_FUSED_OPS(bf16, bf16_t)
AIENG_FUSED_OPS(f32, float)
