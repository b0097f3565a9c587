// take_rows.cu: a row gather, out[B, C] = x[T, C][indices[B]] (e.g. the last token of every sequence
// before the LM head).
//
// Layouts (row-major, C-contiguous):
//   indices [B]     int32, each in [0, T)
//   x       [T, C]  T
//   out     [B, C]  T     (must not overlap x)
// Launch: grid (B), block (threads, 1, 1) with threads a multiple of 32; no shared memory.
#include "common.cuh"

template <typename T>
__global__ void __launch_bounds__(1024) take_rows_kernel(T* __restrict__ out, const T* __restrict__ x,
                                                         const int* __restrict__ indices, int cols) {
  const long long row = blockIdx.x;
  const T* src = x + static_cast<long long>(indices[row]) * cols;
  T* dst = out + row * cols;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = src[c];
}
