// sampling.cu: the next token of every sequence from its logits row: greedy argmax, or a draw after
// temperature, top-k, min-p and top-p filtering.  Only B token ids leave the device.
//
// Layouts (row-major, C-contiguous):
//   logits       [B, V]  T (float32 when the LM head writes float32)
//   out_ids      [B]     int32
//   temperature  [B]     float32   0 means greedy
//   top_k        [B]     int32     0 (or >= V) keeps every token
//   top_p        [B]     float32   1 keeps every token
//   min_p        [B]     float32   0 keeps every token
//   uniform      [B]     float32   a draw from [0, 1) made on the host by the request's own generator
//
// argmax_kernel: out_ids[b] = the index of the largest logit of row b, the first one on ties.
// sample_kernel, for a row with temperature t > 0 (rows with t == 0 take the argmax path):
//   x_i = logit_i / t,  m = max_i x_i,  e_i = exp(x_i - m)
//   S1     = { i : key(x_i) >= key of the k-th largest x }     top-k (ties at the k-th value all kept)
//   S2     = { i in S1 : key(x_i) >= K_p }, K_p the largest key with sum_{S1, key >= K_p} e >= top_p * sum_{S1} e
//            top-p: the smallest set of most likely tokens whose mass reaches top_p (the crossing one kept)
//   S      = { i in S2 : e_i >= min_p }                           min-p (p_i >= min_p * p_max)
//   token  = the first i (in index order) whose running sum of e over S exceeds u * sum_S e
// This is the order and the rule of the CPU sampler (rawinfer/sampler.py), so given the same u both
// backends pick the same token except where float32 rounding decides a boundary.
// key(x) maps a float to an unsigned int with the same order, so "the k-th largest" and "the top-p
// cut" are found by fixing the key one bit at a time from the top: 32 counting (or summing) passes
// over the row, no sort and no extra memory.  Every sum is a fixed-order block reduction, so the same
// row and u give the same token on every run.
//
// Launch (both kernels): grid (B), block (threads, 1, 1) with threads a multiple of 32, at most 1024;
// static shared memory only: 2 x 32 scratch words and a [threads + 1] prefix array (sample_kernel).
// The draw: thread j owns the contiguous chunk [j * ceil(V / threads), ...) of the row; a sequential
// prefix over the chunks' sums (thread 0) tells which chunk holds the target, and that thread walks it.
#include "common.cuh"

#define SAMPLE_MAX_THREADS 1024

RAWINFER_DEVICE unsigned order_key(float x) {
  const unsigned u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

template <typename T>
RAWINFER_DEVICE ArgMax row_argmax(const T* row, int vocab, float* fscratch, int* iscratch) {
  ArgMax best;
  best.value = neg_inf();
  best.index = 0x7FFFFFFF;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) best = argmax_pick(best, ArgMax{to_float(row[i]), i});
  return block_argmax(best, fscratch, iscratch);
}

template <typename T>
__global__ void __launch_bounds__(SAMPLE_MAX_THREADS) argmax_kernel(int* __restrict__ out_ids,
                                                                    const T* __restrict__ logits, int vocab) {
  __shared__ float fscratch[32];
  __shared__ int iscratch[32];
  const ArgMax best = row_argmax(logits + static_cast<long long>(blockIdx.x) * vocab, vocab, fscratch, iscratch);
  if (threadIdx.x == 0) out_ids[blockIdx.x] = best.index;
}

template <typename T>
__global__ void __launch_bounds__(SAMPLE_MAX_THREADS) sample_kernel(
    int* __restrict__ out_ids, const T* __restrict__ logits, const float* __restrict__ temperature,
    const int* __restrict__ top_k, const float* __restrict__ top_p, const float* __restrict__ min_p,
    const float* __restrict__ uniform, int vocab) {
  __shared__ float fscratch[32];
  __shared__ int iscratch[32];
  __shared__ float prefix[SAMPLE_MAX_THREADS + 1];
  __shared__ int last_nonempty;
  const int b = blockIdx.x;
  const T* row = logits + static_cast<long long>(b) * vocab;
  const ArgMax best = row_argmax(row, vocab, fscratch, iscratch);
  const float t = temperature[b];
  if (t == 0.0f) {  // greedy: uniform across the block, so the whole block leaves together
    if (threadIdx.x == 0) out_ids[b] = best.index;
    return;
  }
  const float m = best.value / t;
  const int k = top_k[b];
  const float mp = min_p[b];
  const float tp = top_p[b];

  // top-k: the key of the k-th largest value.
  unsigned key_k = 0u;
  if (k > 0 && k < vocab) {
    for (int bit = 31; bit >= 0; --bit) {
      const unsigned candidate = key_k | (1u << bit);
      int count = 0;
      for (int i = threadIdx.x; i < vocab; i += blockDim.x) count += order_key(to_float(row[i]) / t) >= candidate;
      if (block_count(count, iscratch) >= k) key_k = candidate;
    }
  }
  // e_i of a token that survives top-k, a key floor and (optionally) min-p; 0 for a dropped one.
  auto kept_weight = [&](int i, unsigned key_min, bool apply_min_p) -> float {
    const float x = to_float(row[i]) / t;
    const unsigned key = order_key(x);
    if (key < key_k || key < key_min) return 0.0f;
    const float e = expf(x - m);
    return (apply_min_p && e < mp) ? 0.0f : e;
  };
  // top-p over S1: the largest key whose mass reaches top_p of S1's total.
  unsigned key_p = 0u;
  if (tp < 1.0f) {
    float partial = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) partial += kept_weight(i, 0u, false);
    const float target = tp * block_sum(partial, fscratch);
    for (int bit = 31; bit >= 0; --bit) {
      const unsigned candidate = key_p | (1u << bit);
      partial = 0.0f;
      for (int i = threadIdx.x; i < vocab; i += blockDim.x) partial += kept_weight(i, candidate, false);
      if (block_sum(partial, fscratch) >= target) key_p = candidate;
    }
  }

  // The draw: inverse CDF in index order over contiguous per-thread chunks.
  const int chunk = ceil_div(vocab, blockDim.x);
  const int lo = imin(vocab, threadIdx.x * chunk);
  const int hi = imin(vocab, lo + chunk);
  float mine = 0.0f;
  for (int i = lo; i < hi; ++i) mine += kept_weight(i, key_p, true);
  prefix[threadIdx.x + 1] = mine;
  __syncthreads();
  if (threadIdx.x == 0) {
    prefix[0] = 0.0f;
    last_nonempty = 0;
    for (int j = 1; j <= static_cast<int>(blockDim.x); ++j) {
      if (prefix[j] > 0.0f) last_nonempty = j - 1;
      prefix[j] += prefix[j - 1];
    }
  }
  __syncthreads();
  const float total = prefix[blockDim.x];
  const float target = uniform[b] * total;
  const int me = threadIdx.x;
  const bool holds = mine > 0.0f && prefix[me] <= target && (target < prefix[me + 1] || me == last_nonempty);
  if (holds) {
    // Walk the chunk; if rounding leaves the target beyond the running sum, the chunk's last kept
    // token is the answer (the chunk was chosen by the exact prefix values above).
    float run = prefix[me];
    int pick = -1;
    for (int i = lo; i < hi; ++i) {
      const float w = kept_weight(i, key_p, true);
      if (w > 0.0f) {
        pick = i;
        run += w;
        if (run > target) break;
      }
    }
    out_ids[b] = pick;
  }
}
