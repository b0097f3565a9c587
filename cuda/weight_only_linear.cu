// weight_only_linear.cu: products with a weight-only quantized matrix (rawinfer/quant.py's "int8" and "fp8"
// formats), out[T, N] = x[T, K] @ (q[N, K] * scale[N, None])^T (+ bias[N]).
//
// Layouts (row-major, C-contiguous):
//   x      [T, K]  T      (activations: float32, f16 or bf16)
//   q      [N, K]  W      (signed char: int8 in [-127, 127]; e4m3: float8 e4m3fn, common.cuh)
//   scale  [N]     float32 (one per output row)
//   bias   [N]     O      (read only when has_bias is 1)
//   out    [T, N]  O      (T itself, or float32 for logits)
// A weight's value is weight_value(q) * scale, in float32: both formats are one byte a weight and differ
// only in how a byte reads (common.cuh's weight_value), so every kernel here is a template over W.
//
// Two kernels, chosen by the backend (rawinfer/backend/cuda/weight_only.py) on the row count T:
//
//   wo_gemv_kernel     decode rows (T <= WO_GEMV_MAX_ROWS): one warp per output row n reads q[n, :]
//                      once, 16 bytes a lane per load, and multiplies it with every one of the T rows
//                      of x (T accumulators in registers); a warp reduction, then the scale (and
//                      bias) on the float32 sum, one rounding to O.  Decode is bound by the bytes of
//                      weights read, and a one-byte row is half a bf16 one.
//   wo_dequant_kernel  more rows: a tile of q's rows becomes q * scale in T in a workspace, which the
//                      backend hands to the same cuBLAS GEMM as a float matrix (prefill is bound by
//                      arithmetic, where the tensor cores of the GEMM matter and the extra pass over
//                      the tile does not).
//
// wo_gemv_kernel.  Launch: grid (ceil(N / WO_GEMV_WARPS)), block (32 * WO_GEMV_WARPS); no shared
// memory.  Lane l of a warp takes the 16-byte chunks l, l + 32, ... of the row: consecutive lanes read
// consecutive 16 bytes, so a warp's load is one 512-byte coalesced access.  The vector path needs K a
// multiple of 16 and 16-byte aligned q and x (every real model's K; the pool's carves are 256-byte
// aligned); otherwise the kernel walks K one element a lane, the same sums in a different order.
//
// wo_dequant_kernel.  Launch: grid (rows of the tile), block (threads, 1, 1), threads a multiple of 32;
// no shared memory.  q and scale point at the tile's first row, out is [rows, K].
#include "common.cuh"

constexpr int WO_GEMV_MAX_ROWS = 8;   // WO_GEMV_MAX_ROWS in rawinfer/backend/cuda/weight_only.py
constexpr int WO_GEMV_WARPS = 4;      // WO_GEMV_WARPS there: output rows per block
constexpr int WO_CHUNK = 16;          // one-byte weights per 16-byte load

RAWINFER_DEVICE bool aligned16(const void* p) {
  return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

// acc[m] += x[m, k0 .. k0 + 16) . w[0 .. 16) for every row m < rows, x read as 16-byte vectors.
template <typename T>
RAWINFER_DEVICE void chunk_dot(float (&acc)[WO_GEMV_MAX_ROWS], const float (&w)[WO_CHUNK],
                               const T* __restrict__ x, long long k, long long k0, int rows) {
  constexpr int N = VecOf<T>::N;
#pragma unroll
  for (int m = 0; m < WO_GEMV_MAX_ROWS; ++m) {
    if (m < rows) {
      const T* xr = x + m * k + k0;
#pragma unroll
      for (int p = 0; p < WO_CHUNK / N; ++p) {
        const VecOf<T> xv = load_vec(xr + p * N);
#pragma unroll
        for (int j = 0; j < N; ++j) acc[m] += to_float(xv.v[j]) * w[p * N + j];
      }
    }
  }
}

template <typename W, typename T, typename O>
__global__ void __launch_bounds__(32 * WO_GEMV_WARPS) wo_gemv_kernel(
    O* __restrict__ out, const T* __restrict__ x, const W* __restrict__ q,
    const float* __restrict__ scale, const O* __restrict__ bias, int rows, int n_out, int k, int has_bias) {
  const int lane = threadIdx.x % 32;
  const int n = blockIdx.x * WO_GEMV_WARPS + threadIdx.x / 32;
  if (n >= n_out) return;   // the whole warp leaves: no block-wide barrier follows
  const W* qrow = q + static_cast<long long>(n) * k;
  float acc[WO_GEMV_MAX_ROWS];
#pragma unroll
  for (int m = 0; m < WO_GEMV_MAX_ROWS; ++m) acc[m] = 0.0f;

  if (k % WO_CHUNK == 0 && aligned16(q) && aligned16(x)) {
    const int chunks = k / WO_CHUNK;
    for (int c = lane; c < chunks; c += 32) {
      const long long k0 = static_cast<long long>(c) * WO_CHUNK;
      const VecOf<W> qv = load_vec(qrow + k0);
      float w[WO_CHUNK];
#pragma unroll
      for (int j = 0; j < WO_CHUNK; ++j) w[j] = weight_value(qv.v[j]);
      chunk_dot(acc, w, x, k, k0, rows);
    }
  } else {
    for (int kk = lane; kk < k; kk += 32) {
      const float w = weight_value(qrow[kk]);
#pragma unroll
      for (int m = 0; m < WO_GEMV_MAX_ROWS; ++m) {
        if (m < rows) acc[m] += to_float(x[static_cast<long long>(m) * k + kk]) * w;
      }
    }
  }

  const float s = scale[n];
  const float b = has_bias ? to_float(bias[n]) : 0.0f;
#pragma unroll
  for (int m = 0; m < WO_GEMV_MAX_ROWS; ++m) {
    if (m < rows) {
      const float sum = warp_sum(acc[m]);
      if (lane == 0) out[static_cast<long long>(m) * n_out + n] = from_float<O>(sum * s + b);
    }
  }
}

template <typename W, typename T>
__global__ void __launch_bounds__(1024) wo_dequant_kernel(T* __restrict__ out, const W* __restrict__ q,
                                                         const float* __restrict__ scale, int k) {
  const long long row = blockIdx.x;
  const float s = scale[row];
  const W* src = q + row * k;
  T* dst = out + row * k;
  for (int c = threadIdx.x; c < k; c += blockDim.x) dst[c] = from_float<T>(weight_value(src[c]) * s);
}
