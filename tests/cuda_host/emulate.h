// Runs aieng's CUDA C++ kernels on the host, for CPU tests of their indexing and arithmetic: a
// block's threads are std::threads (one block at a time), __syncthreads and warp shuffles are
// barriers, __shared__ variables are function statics (shared by the block's threads), and the
// few PTX instructions have C++ stand-ins selected by `#ifndef __CUDA_ARCH__` in the sources.
// Floating point as on the GPU where the kernels rely on it: compile with -ffp-contract=off
// (no fused multiply-adds but the explicit fmaf), round-to-nearest-even conversions.
#pragma once

#include <math.h>

#include <array>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct dim3_t {
  unsigned x = 1, y = 1, z = 1;
};
// CUDA's vector types are aligned to their size: a load of one from a misaligned address is an
// error there, and here in the build with -fsanitize=alignment (test_cuda_kernels_on_host.py).
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }

inline thread_local dim3_t threadIdx, blockIdx;
inline dim3_t blockDim, gridDim;

inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
using std::max, std::min;

// float16 / bfloat16 bits <-> float, round to nearest even (what cvt.rn does).
inline float host_half_to_float(unsigned short bits) {
  _Float16 h;
  std::memcpy(&h, &bits, 2);
  return static_cast<float>(h);
}
inline unsigned short host_float_to_half(float v) {
  _Float16 h = static_cast<_Float16>(v);
  unsigned short bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}
inline unsigned short host_float_to_bf16(float v) {
  unsigned u = __float_as_uint(v);
  if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x7FFFFFu)) return (u >> 16) | 0x40;  // NaN
  return static_cast<unsigned short>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// The block being run: its barrier and, per warp, a barrier and the lanes' shuffle values.
struct BlockState {
  explicit BlockState(int threads)
      : block(threads), warps(threads / 32), values(threads), fragments(threads) {
    for (auto& w : warps) w = std::make_unique<std::barrier<>>(32);
  }
  std::barrier<> block;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<float> values;
  std::vector<std::array<unsigned, 6>> fragments;  // mma: each lane's a[4], b[2]
};
inline BlockState* current_block = nullptr;
inline thread_local int linear_thread = 0;

inline void __syncthreads() { current_block->block.arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned, float v, int offset) {
  const int lane = linear_thread % 32, base = linear_thread - lane;
  auto& barrier = *current_block->warps[linear_thread / 32];
  current_block->values[linear_thread] = v;
  barrier.arrive_and_wait();
  const float other = current_block->values[base + (lane ^ offset)];
  barrier.arrive_and_wait();
  return other;
}

// mma.sync.m16n8k16 (row.col, float32 accumulators) for the warp: every lane posts its A and B
// fragments, then computes its own four elements of D from the whole 16x16 A and 16x8 B (the
// fragment layout of the PTX ISA, as cuda/common.cuh documents it). `tag` is the element type
// (f16_t or bf16_t), whose `low_to_float` / `high_to_float` read a packed pair.
template <typename T>
void host_mma_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2], T tag) {
  const int lane = linear_thread % 32, base = linear_thread - lane;
  auto& barrier = *current_block->warps[linear_thread / 32];
  current_block->fragments[linear_thread] = {a[0], a[1], a[2], a[3], b[0], b[1]};
  barrier.arrive_and_wait();
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const auto& f = current_block->fragments[base + l];
    const int g = l / 4, t = l % 4;
    const int rows[4] = {g, g + 8, g, g + 8}, cols[4] = {2 * t, 2 * t, 2 * t + 8, 2 * t + 8};
    for (int r = 0; r < 4; ++r) {
      A[rows[r]][cols[r]] = low_to_float(f[r], tag);
      A[rows[r]][cols[r] + 1] = high_to_float(f[r], tag);
    }
    B[2 * t][g] = low_to_float(f[4], tag);
    B[2 * t + 1][g] = high_to_float(f[4], tag);
    B[2 * t + 8][g] = low_to_float(f[5], tag);
    B[2 * t + 9][g] = high_to_float(f[5], tag);
  }
  const int g = lane / 4, t = lane % 4;
  for (int e = 0; e < 4; ++e) {
    const int row = g + (e / 2) * 8, col = 2 * t + e % 2;
    float sum = d[e];
    for (int k = 0; k < 16; ++k) sum += A[row][k] * B[k][col];
    d[e] = sum;
  }
  barrier.arrive_and_wait();
}

// Run `kernel` (a callable taking no arguments, closing over the kernel's) over grid x block.
inline void launch(dim3_t grid, dim3_t block, const std::function<void()>& kernel) {
  gridDim = grid;
  blockDim = block;
  const int threads = block.x * block.y * block.z;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        BlockState state(threads);
        current_block = &state;
        std::vector<std::thread> pool;
        for (int t = 0; t < threads; ++t)
          pool.emplace_back([&, t] {
            blockIdx = {bx, by, bz};
            threadIdx = {t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
            linear_thread = t;
            kernel();
          });
        for (auto& thread : pool) thread.join();
      }
}

// --- The attention kernels' asynchronous loads (cuda/async_copy.cuh) ---
// cp.async: each thread's copies are queued, a commit closes the open group, and a wait
// performs every group but the newest `pending`, in order. A copy is made only then, so a
// kernel that reads its shared buffer before waiting sees the old bytes, as it could on a GPU.
// With `host_copies_land_early` (run_kernel: AIENG_HOST_COPIES=early) every copy lands when it
// is issued instead, the other end of what the GPU may do: a kernel that issues copies into a
// stage its threads still read clobbers it. Source and destination must be aligned to the
// copy's size, as cp.async requires: a misaligned one aborts the launch.
struct HostCopy {
  void* dst;
  const void* src;
  int bytes;
};
inline thread_local std::vector<HostCopy> host_open_group;
inline thread_local std::vector<std::vector<HostCopy>> host_committed_groups;

inline bool host_copies_land_early = false;

inline void host_cp_async(void* dst, const void* src, int bytes) {
  if (reinterpret_cast<uintptr_t>(dst) % bytes || reinterpret_cast<uintptr_t>(src) % bytes) {
    std::fprintf(stderr, "cp.async of %d bytes from %p to %p: not aligned to %d bytes\n", bytes,
                 src, dst, bytes);
    std::abort();
  }
  if (host_copies_land_early)
    std::memcpy(dst, src, bytes);
  else
    host_open_group.push_back({dst, src, bytes});
}
inline void host_cp_async_commit() {
  host_committed_groups.push_back(std::move(host_open_group));
  host_open_group.clear();
}
inline void host_cp_async_wait(int pending) {
  const size_t done = host_committed_groups.size() > size_t(pending)
                          ? host_committed_groups.size() - size_t(pending)
                          : 0;
  for (size_t g = 0; g < done; ++g)
    for (const HostCopy& copy : host_committed_groups[g]) std::memcpy(copy.dst, copy.src, copy.bytes);
  host_committed_groups.erase(host_committed_groups.begin(), host_committed_groups.begin() + done);
}

// ldmatrix.x4 (.trans) for the warp: every lane posts its row address, then assembles its four
// registers from the 8x8 matrices of 16-bit elements those rows hold (layout in async_copy.cuh).
inline std::array<const unsigned short*, 1024> host_ldmatrix_rows;
inline void host_ldmatrix_x4(unsigned (&r)[4], const void* row, bool transpose) {
  const int lane = linear_thread % 32, base = linear_thread - lane;
  auto& barrier = *current_block->warps[linear_thread / 32];
  if (reinterpret_cast<uintptr_t>(row) % 16) {  // each row 16 bytes, 16-byte aligned
    std::fprintf(stderr, "ldmatrix row %p: not aligned to 16 bytes\n", row);
    std::abort();
  }
  host_ldmatrix_rows[linear_thread] = static_cast<const unsigned short*>(row);
  barrier.arrive_and_wait();
  for (int j = 0; j < 4; ++j) {
    const unsigned short* const* rows = &host_ldmatrix_rows[base + 8 * j];
    unsigned short lo, hi;
    if (transpose) {  // column lane / 4, rows 2 (lane % 4) and the next
      lo = rows[2 * (lane % 4)][lane / 4];
      hi = rows[2 * (lane % 4) + 1][lane / 4];
    } else {  // row lane / 4, columns 2 (lane % 4) and the next
      lo = rows[lane / 4][2 * (lane % 4)];
      hi = rows[lane / 4][2 * (lane % 4) + 1];
    }
    r[j] = unsigned(lo) | (unsigned(hi) << 16);
  }
  barrier.arrive_and_wait();
}
