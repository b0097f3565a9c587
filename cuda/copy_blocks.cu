// copy_blocks.cu: copy whole KV blocks (copy-on-write of a shared prefix block), every layer at once.
//
// Layouts:
//   k_ptrs, v_ptrs  [L]     uint64   device addresses of each layer's k_cache / v_cache [NB, Hkv, BS, D]
//   pairs           [P, 2]  int32    (src block, dst block); no dst appears twice and no dst is a src
//   words_per_block         int      Hkv * BS * D * sizeof(T) / 4: a block is copied as 32-bit words,
//                                    so one kernel serves every element type
// Launch: grid (P, L), block (threads, 1, 1); thread j copies words j, j + threads, ... of one block of
// one layer, for K and for V.
#include "common.cuh"

__global__ void __launch_bounds__(1024) copy_blocks_kernel(const unsigned long long* __restrict__ k_ptrs,
                                                           const unsigned long long* __restrict__ v_ptrs,
                                                           const int* __restrict__ pairs, int words_per_block) {
  const int pair = blockIdx.x;
  const int layer = blockIdx.y;
  const long long src = static_cast<long long>(pairs[2 * pair]) * words_per_block;
  const long long dst = static_cast<long long>(pairs[2 * pair + 1]) * words_per_block;
  unsigned* k = reinterpret_cast<unsigned*>(k_ptrs[layer]);
  unsigned* v = reinterpret_cast<unsigned*>(v_ptrs[layer]);
  for (int i = threadIdx.x; i < words_per_block; i += blockDim.x) {
    k[dst + i] = k[src + i];
    v[dst + i] = v[src + i];
  }
}
