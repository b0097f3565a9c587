// fused_rope_kv_write.cu: everything between the QKV GEMM and attention in one pass over the qkv rows:
// the q/k per-head RMSNorm where the family has one (Qwen3, Gemma 3), RoPE of the q and k heads, and the
// write of this step's K and V into the paged cache.
//
//   fused_rope_kv_write_kernel:       rope(q, k);                     k_cache, v_cache <- k, v
//   fused_norm_rope_kv_write_kernel:  head_rmsnorm(q, k); rope(q, k);  k_cache, v_cache <- k, v
//
// Each is head_rmsnorm_kernel, rope_kernel and kv_write_kernel run one after another, bit for bit: the sum
// of squares is taken in head_rmsnorm's order (lane d, d + 32, ..., then the warp's butterfly), the
// normalised values are rounded to T before they are rotated, and the rotated k is stored exactly as it
// is written back.  The three kernels read and write qkv's q and k heads three times; this one reads each
// value once (twice with the norm: the second read of a head comes from L1) and writes it once.
//
// Layouts (row-major, C-contiguous):
//   qkv            [T, (H + 2*Hkv) * D]  T      | q heads (H) | k heads (Hkv) | v heads (Hkv) |, each D wide;
//                                               q and k rotated in place (attention reads q here)
//   q_weight, k_weight [D]               T      the norms' multipliers (Gemma's 1 + w already added)
//   positions      [T]                   int32  position of each token (< P)
//   cos_sin        [P, D]                float32  cos in [:, :D/2], sin in [:, D/2:] (the layer's table:
//                                               local or global theta, llama3 frequencies, all host-built)
//   slot_mapping   [T]                   int32  slot = block * BS + row
//   k_cache, v_cache [NB, Hkv, BS, D]    T      head h of the token at ((block * Hkv + h) * BS + row) * D
// RoPE pairs element i of a head with i + D/2 (Hugging Face "rotate_half").
// Launch: grid (T, ceil((H + 2*Hkv) / HEADS_PER_BLOCK)), block (32 * HEADS_PER_BLOCK, 1, 1); no shared
// memory.  Warp w of block (t, y) owns head y * HEADS_PER_BLOCK + w of token t: a q or k head is
// normalised with one shuffle reduction, then lane j rotates pairs j, j + 32, ...; a v head is copied.
// Warps past the last head return at once (nothing they skip synchronises with others).  Each lane
// reads and writes only its own pairs after the reduction, so the rotation in place is safe.  Distinct
// tokens have distinct slots (the block manager guarantees it; a decode graph's padding rows all write
// the padding block, which nothing reads).  T sits in grid.x because grid.y is limited to 65535.
#include "common.cuh"

#define FUSED_HEADS_PER_BLOCK 4

template <bool NORM, typename T>
RAWINFER_DEVICE void rope_kv_write_head(T* __restrict__ qkv, T* __restrict__ k_cache, T* __restrict__ v_cache,
                                        const T* __restrict__ q_weight, const T* __restrict__ k_weight,
                                        const int* __restrict__ positions, const float* __restrict__ cos_sin,
                                        const int* __restrict__ slot_mapping, int num_heads, int num_kv_heads,
                                        int head_dim, int block_size, float eps) {
  const int lane = threadIdx.x % 32;
  const int head = blockIdx.y * FUSED_HEADS_PER_BLOCK + threadIdx.x / 32;
  const int heads = num_heads + 2 * num_kv_heads;
  if (head >= heads) return;  // the whole warp leaves together
  const long long token = blockIdx.x;
  T* x = qkv + token * heads * head_dim + static_cast<long long>(head) * head_dim;
  const long long slot = slot_mapping[token];
  const long long block = slot / block_size;
  const long long in_block = slot - block * block_size;
  const int kv_head = head - num_heads - (head >= num_heads + num_kv_heads ? num_kv_heads : 0);
  const long long dst = ((block * num_kv_heads + kv_head) * block_size + in_block) * head_dim;
  if (head >= num_heads + num_kv_heads) {  // a v head: copied as it is
    for (int d = lane; d < head_dim; d += 32) v_cache[dst + d] = x[d];
    return;
  }
  const bool is_k = head >= num_heads;
  float inv_rms = 1.0f;
  const T* weight = is_k ? k_weight : q_weight;
  if (NORM) {
    float sum_sq = 0.0f;
    for (int d = lane; d < head_dim; d += 32) {
      const float v = to_float(x[d]);
      sum_sq += v * v;
    }
    sum_sq = warp_sum(sum_sq);  // every lane has read the whole head before any lane writes
    inv_rms = rsqrtf(sum_sq / static_cast<float>(head_dim) + eps);
  }
  const int half = head_dim / 2;
  const float* cs = cos_sin + static_cast<long long>(positions[token]) * head_dim;
  for (int i = lane; i < half; i += 32) {
    float x1 = to_float(x[i]);
    float x2 = to_float(x[i + half]);
    if (NORM) {  // rounded to T, as head_rmsnorm stores it
      x1 = to_float(from_float<T>(x1 * inv_rms * to_float(weight[i])));
      x2 = to_float(from_float<T>(x2 * inv_rms * to_float(weight[i + half])));
    }
    const float c = cs[i];
    const float s = cs[half + i];
    const T r1 = from_float<T>(x1 * c - x2 * s);
    const T r2 = from_float<T>(x2 * c + x1 * s);
    x[i] = r1;
    x[i + half] = r2;
    if (is_k) {
      k_cache[dst + i] = r1;
      k_cache[dst + i + half] = r2;
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(32 * FUSED_HEADS_PER_BLOCK) fused_rope_kv_write_kernel(
    T* __restrict__ qkv, T* __restrict__ k_cache, T* __restrict__ v_cache, const int* __restrict__ positions,
    const float* __restrict__ cos_sin, const int* __restrict__ slot_mapping, int num_heads, int num_kv_heads,
    int head_dim, int block_size) {
  rope_kv_write_head<false, T>(qkv, k_cache, v_cache, nullptr, nullptr, positions, cos_sin, slot_mapping,
                               num_heads, num_kv_heads, head_dim, block_size, 0.0f);
}

template <typename T>
__global__ void __launch_bounds__(32 * FUSED_HEADS_PER_BLOCK) fused_norm_rope_kv_write_kernel(
    T* __restrict__ qkv, T* __restrict__ k_cache, T* __restrict__ v_cache, const T* __restrict__ q_weight,
    const T* __restrict__ k_weight, const int* __restrict__ positions, const float* __restrict__ cos_sin,
    const int* __restrict__ slot_mapping, int num_heads, int num_kv_heads, int head_dim, int block_size,
    float eps) {
  rope_kv_write_head<true, T>(qkv, k_cache, v_cache, q_weight, k_weight, positions, cos_sin, slot_mapping,
                              num_heads, num_kv_heads, head_dim, block_size, eps);
}
