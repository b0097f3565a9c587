// silu_mul.cu: the SwiGLU activation, out[T, F] = silu(gate_up[:, :F]) * gate_up[:, F:].
//
// Layouts (row-major, C-contiguous):
//   gate_up [T, 2F]  T    (the fused gate/up GEMM output: gate in the first F columns, up in the last F)
//   out     [T, F]   T
// silu(g) = g / (1 + exp(-g)), computed in float32; one rounding to T at the store.
// Launch: grid (T, ceil(F / threads)), block (threads, 1, 1); one element per thread, no shared memory.
// T sits in grid.x because grid.y is limited to 65535.
#include "common.cuh"

template <typename T>
__global__ void __launch_bounds__(1024) silu_mul_kernel(T* __restrict__ out, const T* __restrict__ gate_up,
                                                        int ffn) {
  const long long token = blockIdx.x;
  const int f = blockIdx.y * blockDim.x + threadIdx.x;
  if (f >= ffn) return;
  const T* row = gate_up + token * 2 * ffn;
  const float g = to_float(row[f]);
  const float u = to_float(row[ffn + f]);
  out[token * ffn + f] = from_float<T>(g / (1.0f + expf(-g)) * u);
}
