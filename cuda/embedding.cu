// embedding.cu: the token embedding gather, out[T, C] = table[V, C][ids[T]] * scale.
//
// Layouts (row-major, C-contiguous):
//   ids    [T]     int32, each in [0, V) (the tokenizer and the engine guarantee it; not checked here)
//   table  [V, C]  T      (the weights' storage type)
//   out    [T, C]  R      (the residual stream: float32, or T itself)
// scale: Gemma multiplies its embeddings by sqrt(C); every other model passes 1, and x * 1.0f is exact,
// so the gather then copies bits.  The product is taken in float32 and rounded once to R.
// Launch: grid (T), block (threads, 1, 1) with threads a multiple of 32; no shared memory.
// Thread j of block t copies elements j, j + threads, ... of row ids[t]: consecutive threads touch
// consecutive addresses, so every warp access is one coalesced transaction.
#include "common.cuh"

template <typename T, typename R>
__global__ void __launch_bounds__(1024) embedding_kernel(R* __restrict__ out, const int* __restrict__ ids,
                                                         const T* __restrict__ table, int hidden, float scale) {
  const long long token = blockIdx.x;
  const T* src = table + static_cast<long long>(ids[token]) * hidden;
  R* dst = out + token * hidden;
  for (int c = threadIdx.x; c < hidden; c += blockDim.x) dst[c] = from_float<R>(to_float(src[c]) * scale);
}
