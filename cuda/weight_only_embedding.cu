// weight_only_embedding.cu: the token embedding gather from a weight-only table (rawinfer/quant.py's "int8"
// and "fp8" formats), out[T, C] = (weight_value(q[V, C][ids[T]]) * row_scale[ids[T]]) * scale.
//
// Layouts (row-major, C-contiguous):
//   ids        [T]     int32, each in [0, V) (the tokenizer and the engine guarantee it; not checked here)
//   q          [V, C]  W      (signed char or e4m3: common.cuh's weight_value reads either)
//   row_scale  [V]     float32 (the table's per-row scale)
//   out        [T, C]  R      (the residual stream: float32, or the activation dtype)
// scale: Gemma's sqrt(C), 1 for every other model.  Both products in float32, in the CPU backend's
// order (the row dequantized, then scaled), one rounding to R.
// Launch: grid (T), block (threads, 1, 1) with threads a multiple of 32; no shared memory.
#include "common.cuh"

template <typename W, typename R>
__global__ void __launch_bounds__(1024) wo_embedding_kernel(R* __restrict__ out, const int* __restrict__ ids,
                                                           const W* __restrict__ q,
                                                           const float* __restrict__ row_scale, int hidden,
                                                           float scale) {
  const long long token = blockIdx.x;
  const int id = ids[token];
  const W* src = q + static_cast<long long>(id) * hidden;
  const float s = row_scale[id];
  R* dst = out + token * hidden;
  for (int c = threadIdx.x; c < hidden; c += blockDim.x) dst[c] = from_float<R>(weight_value(src[c]) * s * scale);
}
