// silu_mul.cu: the gated activations of the MLP, out[T, F] = act(gate_up[:, :F]) * gate_up[:, F:].
//
//   silu_mul_kernel:       act = silu(g) = g / (1 + exp(-g))                              (SwiGLU)
//   gelu_tanh_mul_kernel:  act = gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))  (GeGLU)
//
// Layouts (row-major, C-contiguous):
//   gate_up [T, 2F]  T    (the fused gate/up GEMM output: gate in the first F columns, up in the last F)
//   out     [T, F]   T
// Both kernels are one body, gated_activation<Act, T>, with the activation as a functor; computed in
// float32, one rounding to T at the store.
// Launch: grid (T, ceil(F / threads)), block (threads, 1, 1); one element per thread, no shared memory.
// T sits in grid.x because grid.y is limited to 65535.
#include "common.cuh"

struct SiLU {
  static RAWINFER_DEVICE float apply(float g) { return g / (1.0f + expf(-g)); }
};

// 0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u)) exactly, so gelu_tanh(g) = g / (1 + exp(-2u)): the same value
// as the tanh form without its cancellation in 1 + tanh(u) for negative g.  For very negative g,
// exp(-2u) overflows to +inf and the quotient is -0, the limit.
struct GeluTanh {
  static RAWINFER_DEVICE float apply(float g) {
    const float u = 0.7978845608028654f * (g + 0.044715f * g * g * g);  // sqrt(2 / pi) (g + 0.044715 g^3)
    return g / (1.0f + expf(-2.0f * u));
  }
};

template <typename Act, typename T>
RAWINFER_DEVICE void gated_activation(T* __restrict__ out, const T* __restrict__ gate_up, int ffn) {
  const long long token = blockIdx.x;
  const int f = blockIdx.y * blockDim.x + threadIdx.x;
  if (f >= ffn) return;
  const T* row = gate_up + token * 2 * ffn;
  const float g = to_float(row[f]);
  const float u = to_float(row[ffn + f]);
  out[token * ffn + f] = from_float<T>(Act::apply(g) * u);
}

template <typename T>
__global__ void __launch_bounds__(1024) silu_mul_kernel(T* __restrict__ out, const T* __restrict__ gate_up,
                                                        int ffn) {
  gated_activation<SiLU>(out, gate_up, ffn);
}

template <typename T>
__global__ void __launch_bounds__(1024) gelu_tanh_mul_kernel(T* __restrict__ out, const T* __restrict__ gate_up,
                                                             int ffn) {
  gated_activation<GeluTanh>(out, gate_up, ffn);
}
