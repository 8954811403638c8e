// async_copy.cuh — the attention kernels' asynchronous loads, in inline PTX (sm_80 or newer):
// cp.async global -> shared copies of 16 or 8 bytes, their commit / wait groups, and ldmatrix
// (four 8x8 matrices of 16-bit elements from shared memory, plain or transposed). Without
// __CUDA_ARCH__ (the host emulation of tests/cuda_host/emulate.h) each has its C++ stand-in:
// the copies are queued per thread and performed only when a wait retires their group, so a
// read that forgets to wait sees stale data there as it would on the GPU.
#pragma once

#ifdef __CUDA_ARCH__
__device__ __forceinline__ unsigned shared_address(const void* p) {
  unsigned address;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(address) : "l"(p));
  return address;
}
#endif

// dst (shared) <- src (global), BYTES = 16 (bypassing L1) or 8, both aligned to BYTES.
template <int BYTES>
__device__ __forceinline__ void cp_async(void* dst, const void* src) {
  static_assert(BYTES == 16 || BYTES == 8, "cp.async copies 16 or 8 bytes here");
#ifdef __CUDA_ARCH__
  if constexpr (BYTES == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared_address(dst)), "l"(src)
                 : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(shared_address(dst)), "l"(src)
                 : "memory");
#else
  host_cp_async(dst, src, BYTES);
#endif
}

// Closes the group of this thread's copies issued since the last commit.
__device__ __forceinline__ void cp_async_commit() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.commit_group;" ::: "memory");
#else
  host_cp_async_commit();
#endif
}

// Waits until at most PENDING of this thread's committed groups are still in flight: the
// older groups' data is then in shared memory, visible to this thread.
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
#else
  host_cp_async_wait(PENDING);
#endif
}

// Four 8x8 matrices of 16-bit elements from shared memory, for the whole warp: lane l gives the
// address of row l % 8 of matrix l / 8 (16 bytes, 16-byte aligned). Plain: r[j] holds row l / 4,
// columns 2 (l % 4) and 2 (l % 4) + 1 of matrix j (low, high); transposed: rows 2 (l % 4) and
// 2 (l % 4) + 1 of column l / 4.
template <bool TRANSPOSE>
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row) {
#ifdef __CUDA_ARCH__
  if constexpr (TRANSPOSE)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
#else
  host_ldmatrix_x4(r, row, TRANSPOSE);
#endif
}
