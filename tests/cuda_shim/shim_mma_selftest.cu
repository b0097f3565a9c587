// shim_mma_selftest.cu: kernels that pin the shim's tensor-core wrappers (common.cuh: mma_m16n8k16,
// ldmatrix_x4, cp_async_16) to the PTX ISA's documented fragment layouts (tests/backend/test_cuda_shim_mma.py).
// Each kernel is one warp that moves registers between global memory and a wrapper unchanged, so the
// test sees exactly which element each lane's register holds.
//
//   mma_layout_kernel<T>    a [32, 4], b [32, 2] fragment registers and c [32, 4] accumulators per lane in,
//                           d [32, 4] out: d = A B + C in the lanes' fragment layout
//   ldmatrix_layout_kernel  src: four 8 x 8 matrices of 16-bit elements ([32 rows, 4 words]) copied to
//                           shared memory at a row stride of 48 bytes; out [32, 4]: each lane's registers
//                           after ldmatrix_x4 (trans = 0) or ldmatrix_x4_trans (trans = 1)
//   cp_async_kernel         what shared memory holds before and after each cp_async_wait (host shim only:
//                           on a GPU the reads before a wait race with the copy)
//   cp_async_unwaited_kernel commits a copy and never waits: the shim must abort
#include "common.cuh"

template <typename T>
__global__ void mma_layout_kernel(float* d, const unsigned* a, const unsigned* b, const float* c) {
  const int lane = threadIdx.x;
  unsigned ra[4], rb[2];
  float acc[4];
  for (int i = 0; i < 4; ++i) ra[i] = a[lane * 4 + i];
  for (int i = 0; i < 2; ++i) rb[i] = b[lane * 2 + i];
  for (int i = 0; i < 4; ++i) acc[i] = c[lane * 4 + i];
  mma_m16n8k16<T>(acc, ra, rb);
  for (int i = 0; i < 4; ++i) d[lane * 4 + i] = acc[i];
}

__global__ void ldmatrix_layout_kernel(unsigned* out, const unsigned* src, int trans) {
  DYNAMIC_SHARED(unsigned, s);  // [32 rows, 12 words]: 4 words of data, 8 of gap
  const int lane = threadIdx.x;
  for (int w = 0; w < 4; ++w) s[lane * 12 + w] = src[lane * 4 + w];
  __syncwarp();
  unsigned r[4];
  if (trans) {
    ldmatrix_x4_trans(r, s + lane * 12);
  } else {
    ldmatrix_x4(r, s + lane * 12);
  }
  for (int i = 0; i < 4; ++i) out[lane * 4 + i] = r[i];
}

// out [5, 32, 4]: group 0 before any wait, group 0 and group 1 after wait<1>, group 1 and the zero-filled
// copy after wait<0>.
__global__ void cp_async_kernel(float* out, const float* src) {
  DYNAMIC_SHARED(float, s);  // [3, 32, 4]
  const int t = threadIdx.x;
  cp_async_16(s + t * 4, src + t * 4, true);
  cp_async_commit();
  cp_async_16(s + 128 + t * 4, src + 128 + t * 4, true);
  cp_async_16(s + 256 + t * 4, src + t * 4, false);
  cp_async_commit();
  for (int j = 0; j < 4; ++j) out[t * 4 + j] = s[t * 4 + j];
  cp_async_wait<1>();
  for (int j = 0; j < 4; ++j) {
    out[128 + t * 4 + j] = s[t * 4 + j];
    out[256 + t * 4 + j] = s[128 + t * 4 + j];
  }
  cp_async_wait<0>();
  for (int j = 0; j < 4; ++j) {
    out[384 + t * 4 + j] = s[128 + t * 4 + j];
    out[512 + t * 4 + j] = s[256 + t * 4 + j];
  }
}

__global__ void cp_async_unwaited_kernel(float* out, const float* src) {
  DYNAMIC_SHARED(float, s);
  cp_async_16(s + threadIdx.x * 4, src + threadIdx.x * 4, true);
  cp_async_commit();
  out[threadIdx.x] = 1.0f;
}
