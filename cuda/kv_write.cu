// kv_write.cu: scatter this step's K and V heads into the paged KV cache by slot.
//
// Layouts (row-major, C-contiguous):
//   qkv           [T, (H + 2*Hkv) * D]  T      k head h at columns (H + h) * D, v head h at (H + Hkv + h) * D
//   slot_mapping  [T]                   int32  slot = block * BS + row, each slot in [0, NB * BS)
//   k_cache, v_cache [NB, Hkv, BS, D]   T      token (block, row) of KV head h lives at
//                                              ((block * Hkv + h) * BS + row) * D
// Launch: grid (T), block (threads, 1, 1); thread j copies elements j, j + threads, ... of the token's
// Hkv * D key values and the same elements of its value values.  Distinct tokens have distinct slots
// (the block manager guarantees it), so no two threads write the same address.
#include "common.cuh"

template <typename T>
__global__ void __launch_bounds__(1024) kv_write_kernel(T* __restrict__ k_cache, T* __restrict__ v_cache,
                                                        const T* __restrict__ qkv,
                                                        const int* __restrict__ slot_mapping, int num_heads,
                                                        int num_kv_heads, int head_dim, int block_size) {
  const long long token = blockIdx.x;
  const T* row = qkv + token * (num_heads + 2 * num_kv_heads) * head_dim;
  const T* k = row + num_heads * head_dim;
  const T* v = k + num_kv_heads * head_dim;
  const long long slot = slot_mapping[token];
  const long long block = slot / block_size;
  const long long in_block = slot - block * block_size;
  const int n = num_kv_heads * head_dim;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int h = i / head_dim;
    const int d = i - h * head_dim;
    const long long dst = ((block * num_kv_heads + h) * block_size + in_block) * head_dim + d;
    k_cache[dst] = k[i];
    v_cache[dst] = v[i];
  }
}
