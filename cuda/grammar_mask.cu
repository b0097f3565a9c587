// grammar_mask.cu: structured output's token mask on the logits, in place: every token a row's grammar
// forbids gets -inf, so neither the device sampler nor argmax (sampling.cu) nor a host draw can pick it.
//
// Layouts (row-major, C-contiguous):
//   logits   [S, V]  T      the step's logits rows (float32 when the LM head writes float32)
//   bitmask  [R, W]  int32  token v is allowed when bit (v % 32) of word v / 32 is set (llguidance's layout);
//                           W >= ceil(V / 32); ids past the tokenizer's vocabulary have their bit clear
//   rows     [R]     int32  the logits row each bitmask row applies to (rows without a grammar are absent)
//
// Launch: grid (ceil(V / 256), R), block (256, 1, 1): one thread per logit, no shared memory.  The 32
// threads of a warp read the same bitmask word (one broadcast load per 32 logits) and write only the
// logits that are masked, so the kernel costs about one pass over the masked rows.
#include "common.cuh"

#define GRAMMAR_MASK_THREADS 256

template <typename T>
__global__ void __launch_bounds__(GRAMMAR_MASK_THREADS) grammar_mask_kernel(
    T* __restrict__ logits, const int* __restrict__ bitmask, const int* __restrict__ rows, int vocab, int words) {
  const int v = blockIdx.x * blockDim.x + threadIdx.x;
  if (v >= vocab) return;
  const int r = blockIdx.y;
  const unsigned word = static_cast<unsigned>(bitmask[static_cast<long long>(r) * words + (v >> 5)]);
  if (((word >> (v & 31)) & 1u) == 0u) logits[static_cast<long long>(rows[r]) * vocab + v] = from_float<T>(neg_inf());
}
