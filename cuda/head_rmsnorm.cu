// head_rmsnorm.cu: RMSNorm over every query and key head of the fused qkv rows, in place (Qwen3's and
// Gemma 3's q/k norm, applied before RoPE).
//
//   q head h:  x = x / sqrt(mean(x^2) + eps) * q_weight      (h < H)
//   k head h:  x = x / sqrt(mean(x^2) + eps) * k_weight      (H <= h < H + Hkv)
//   v heads:   untouched
//
// Layouts (row-major, C-contiguous):
//   qkv       [T, (H + 2*Hkv) * D]  T     q heads, then k heads, then v heads; head h at columns h * D
//   q_weight  [D]                   T
//   k_weight  [D]                   T
// Statistics are float32; one rounding to T at the store.
// Launch: grid (T, ceil((H + Hkv) / HEADS_PER_BLOCK)), block (32 * HEADS_PER_BLOCK, 1, 1); no shared
// memory.  Warp w of block (t, y) owns head y * HEADS_PER_BLOCK + w of token t: a head of D <= 256
// values is 8 per lane at most, so one warp and one shuffle reduction per head, no block barrier.
// Warps past the last head return at once (nothing they skip synchronises with others).  Each lane
// reads and writes only its own columns, so the kernel works in place.  T sits in grid.x because
// grid.y is limited to 65535.
#include "common.cuh"

#define HEADS_PER_BLOCK 4

template <typename T>
__global__ void __launch_bounds__(32 * HEADS_PER_BLOCK) head_rmsnorm_kernel(
    T* __restrict__ qkv, const T* __restrict__ q_weight, const T* __restrict__ k_weight, int num_heads,
    int num_kv_heads, int head_dim, float eps) {
  const int lane = threadIdx.x % 32;
  const int head = blockIdx.y * HEADS_PER_BLOCK + threadIdx.x / 32;
  if (head >= num_heads + num_kv_heads) return;  // the whole warp leaves together
  const long long row_len = static_cast<long long>(num_heads + 2 * num_kv_heads) * head_dim;
  T* x = qkv + static_cast<long long>(blockIdx.x) * row_len + static_cast<long long>(head) * head_dim;
  const T* weight = head < num_heads ? q_weight : k_weight;
  float sum_sq = 0.0f;
  for (int d = lane; d < head_dim; d += 32) {
    const float v = to_float(x[d]);
    sum_sq += v * v;
  }
  sum_sq = warp_sum(sum_sq);
  const float inv_rms = rsqrtf(sum_sq / static_cast<float>(head_dim) + eps);
  for (int d = lane; d < head_dim; d += 32) x[d] = from_float<T>(to_float(x[d]) * inv_rms * to_float(weight[d]));
}
