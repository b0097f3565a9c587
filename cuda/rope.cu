// rope.cu: rotary position embedding applied in place to the q and k heads of the fused QKV rows.
//
// Layouts (row-major, C-contiguous):
//   qkv        [T, (H + 2*Hkv) * D]  T      | q heads (H) | k heads (Hkv) | v heads (Hkv) |, each D wide;
//                                           the H + Hkv heads rotated here are the first (H + Hkv) * D
//                                           columns of each row, so one loop covers q and k alike
//   positions  [T]                   int32  position of each token (< P)
//   cos_sin    [P, D]                float32  cos(pos * inv_freq[i]) in [:, :D/2], sin in [:, D/2:]
//                                           (the host builds it once, default or llama3 frequencies)
// Hugging Face "rotate_half" pairing: element i of a head pairs with element i + D/2:
//   x[i]       <- x[i] * cos[i] - x[i + D/2] * sin[i]
//   x[i + D/2] <- x[i + D/2] * cos[i] + x[i] * sin[i]
// Launch: grid (T), block (threads, 1, 1); thread j handles pairs j, j + threads, ... of the row's
// (H + Hkv) * D/2 pairs; each pair is read and written by exactly one thread, so in place is safe.
#include "common.cuh"

template <typename T>
__global__ void __launch_bounds__(1024) rope_kernel(T* __restrict__ qkv, const int* __restrict__ positions,
                                                    const float* __restrict__ cos_sin, int num_heads,
                                                    int num_kv_heads, int head_dim) {
  const long long token = blockIdx.x;
  const int half = head_dim / 2;
  T* row = qkv + token * (num_heads + 2 * num_kv_heads) * head_dim;
  const float* cs = cos_sin + static_cast<long long>(positions[token]) * head_dim;
  const int pairs = (num_heads + num_kv_heads) * half;
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int head = p / half;
    const int i = p - head * half;
    T* x = row + head * head_dim;
    const float x1 = to_float(x[i]);
    const float x2 = to_float(x[i + half]);
    const float c = cs[i];
    const float s = cs[half + i];
    x[i] = from_float<T>(x1 * c - x2 * s);
    x[i + half] = from_float<T>(x2 * c + x1 * s);
  }
}
