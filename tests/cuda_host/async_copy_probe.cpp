// Checks the host stand-ins of cuda/async_copy.cuh (tests/test_cuda_attention_on_host.py).
#include "emulate.h"

#include "async_copy.cuh"

#include <atomic>
#include <cstdio>

std::atomic<int> failures{0};
void expect(bool ok, const char* what) {
  if (!ok && failures++ < 8) std::fprintf(stderr, "lane %d: %s\n", linear_thread, what);
}

unsigned short source[2][4][8][8];  // two sets of four 8x8 matrices

void kernel() {
  __shared__ __align__(16) unsigned short stage[2][32][8];
  __shared__ __align__(16) unsigned short plain[4][8][8], flipped[4][8][8];
  const int lane = threadIdx.x;
  for (int i = 0; i < 8; ++i) stage[0][lane][i] = stage[1][lane][i] = 0;
  // two groups: lane's row of set 0, then of set 1
  cp_async<16>(&stage[0][lane][0], &source[0][lane / 8][lane % 8][0]);
  cp_async_commit();
  cp_async<16>(&stage[1][lane][0], &source[1][lane / 8][lane % 8][0]);
  cp_async_commit();
  expect(stage[0][lane][3] == 0, "a copy landed before its wait");
  cp_async_wait<1>();
  expect(stage[0][lane][3] == source[0][lane / 8][lane % 8][3], "wait_group 1 left the older group");
  expect(stage[1][lane][3] == 0, "wait_group 1 retired the newest group");
  cp_async_wait<0>();
  expect(stage[1][lane][7] == source[1][lane / 8][lane % 8][7], "wait_group 0 left a group");
  // ldmatrix: the plain load of M and the transposed load of M^T give the same fragments
  for (int i = 0; i < 8; ++i) {
    plain[lane / 8][lane % 8][i] = source[0][lane / 8][lane % 8][i];
    flipped[lane / 8][i][lane % 8] = source[0][lane / 8][lane % 8][i];
  }
  __syncthreads();
  unsigned a[4], b[4];
  ldmatrix_x4<false>(a, &plain[lane / 8][lane % 8][0]);
  ldmatrix_x4<true>(b, &flipped[lane / 8][lane % 8][0]);
  for (int j = 0; j < 4; ++j) expect(a[j] == b[j], "ldmatrix.trans of the transpose differs");
  // and lane 4 g + t holds row g, columns 2t and 2t + 1 of each matrix (the mma B layout)
  for (int j = 0; j < 4; ++j) {
    const unsigned short* row = source[0][j][lane / 4];
    expect(a[j] == (row[2 * (lane % 4)] | unsigned(row[2 * (lane % 4) + 1]) << 16),
           "ldmatrix fragment layout");
  }
}

int main() {
  for (int s = 0; s < 2; ++s)
    for (int j = 0; j < 4; ++j)
      for (int r = 0; r < 8; ++r)
        for (int c = 0; c < 8; ++c) source[s][j][r][c] = 1 + s * 256 + j * 64 + r * 8 + c;
  launch({1, 1, 1}, {32, 1, 1}, kernel);
  std::printf("%d failures\n", failures.load());
  return failures.load() != 0;
}
