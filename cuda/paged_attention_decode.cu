// paged_attention_decode.cu: attention of one new query token per sequence against its paged KV
// cache, split over the context ("split-K" / flash-decoding) and merged by a second kernel.
//
// Layouts (row-major, C-contiguous):
//   qkv               [T, (H + 2*Hkv) * D]  T      the query of sequence b is row query_start_loc[b]
//   k_cache, v_cache  [NB, Hkv, BS, D]      T      position p of sequence b, KV head h:
//                                                  block_tables[b, p / BS], row p % BS
//   block_tables      [B, MB]               int32
//   context_lens      [B]                   int32  >= 1, includes this step's token (already written)
//   query_start_loc   [B + 1]               int32
//   part_out          [B, H, S, D]          float  unnormalised partial outputs sum_t exp(s_t - m) v_t
//   part_max          [B, H, S]             float  m, the largest score of the split
//   part_sum          [B, H, S]             float  sum_t exp(s_t - m)
//   out               [T, H * D]            T
//
// Sliding window: window W > 0 means the query (at position ctx - 1) sees positions [first, ctx) with
// first = max(0, ctx - W); W = 0 means first = 0 (full causal attention).  The splits start at first,
// not at 0: positions before the window are never read, nor are their block table entries, which may
// be stale (the scheduler may free blocks that slid out of the window).
//
// paged_attention_decode_kernel
//   grid (S, Hkv, B), block (128, 1, 1).  Block (s, h, b) covers positions
//   [first + s * P, min(first + (s+1) * P, ctx)) of sequence b for KV head h and ALL G = H / Hkv query
//   heads that share it: each K/V row is fetched from memory once per step, not G times.
//   S = ceil(min(max_context_len, W) / P) (W = 0: ceil(max_context_len / P)) is a host-side bound; blocks
//   past a sequence's context return at once, so the grid may be sized for the longest context the
//   engine allows (what a captured CUDA graph needs).
//   Dynamic shared memory, floats:  q_s [G, D] | p_s [G, P] | red_s [NG, GC, D]
//   Three phases:
//     1. scores: thread j takes positions j, j + 128, ...; it streams its K row in 16-byte vectors and
//        dots it with the G (pre-scaled) queries held in shared memory (all lanes read the same query
//        element: a broadcast).  No shuffles: a warp reads 32 rows side by side.
//     2. softmax statistics: warp w reduces heads w, w + 4, ...: max, exp, sum (warp shuffles).
//     3. P.V: the 128 threads form NG = 128 / (D / VEC) token groups of D / VEC threads; each thread owns
//        one 16-byte slice of the output for GC heads at a time and walks the group's positions; the
//        groups' partial sums meet in red_s.
//
// paged_attention_merge_kernel
//   grid (H, B), block (threads, 1, 1): out = sum_s exp(m_s - M) o_s / sum_s exp(m_s - M) l_s over the
//   splits that hold positions of the sequence, s < ceil((ctx - first) / P) (M = max_s m_s).
//   NOTE: because the splits start at the window's first position, every split the merge reads holds at
//   least one position (a finite m_s, l_s >= 1); the splits past it returned without writing and are
//   not read.
//
// Requirements checked by the host: D * sizeof(T) a multiple of 16 and D <= 256, H a multiple of Hkv,
// P a multiple of BS, all pointers 16-byte aligned.
#include "common.cuh"

#define DECODE_THREADS 128
#define DECODE_HEADS_PER_PASS 4  // GC: query heads accumulated together in phase 3 (registers: GC * VEC)

template <typename T>
__global__ void __launch_bounds__(DECODE_THREADS) paged_attention_decode_kernel(
    float* __restrict__ part_out, float* __restrict__ part_max, float* __restrict__ part_sum,
    const T* __restrict__ qkv, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
    const int* __restrict__ block_tables, const int* __restrict__ context_lens,
    const int* __restrict__ query_start_loc, float scale, int num_heads, int num_kv_heads, int head_dim,
    int block_size, int max_blocks_per_seq, int partition_size, int num_splits, int window) {
  constexpr int VEC = VecOf<T>::N;
  constexpr int GC = DECODE_HEADS_PER_PASS;
  const int split = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int seq = blockIdx.z;
  const int ctx = context_lens[seq];
  const int first = window > 0 ? imax(0, ctx - window) : 0;  // the query's first visible position
  const int start = first + split * partition_size;
  if (start >= ctx) return;  // the whole block leaves together: no barrier is skipped by some threads
  const int n = imin(partition_size, ctx - start);

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int group = num_heads / num_kv_heads;  // G
  const int D = head_dim;
  const long long row_len = static_cast<long long>(num_heads + 2 * num_kv_heads) * D;
  const int* table = block_tables + static_cast<long long>(seq) * max_blocks_per_seq;
  const long long tile = static_cast<long long>(block_size) * D;  // one (block, KV head) tile

  DYNAMIC_SHARED(float, smem);
  float* q_s = smem;                          // [G, D]
  float* p_s = q_s + group * D;               // [G, P]
  float* red_s = p_s + group * partition_size;  // [NG, GC, D]

  // Phase 0: the G query heads of this KV head (contiguous in the row), scaled once here.
  const T* q = qkv + static_cast<long long>(query_start_loc[seq]) * row_len +
               static_cast<long long>(kv_head) * group * D;
  for (int i = tid; i < group * D; i += DECODE_THREADS) q_s[i] = to_float(q[i]) * scale;
  __syncthreads();

  // Phase 1: scores, one position per thread.
  for (int j = tid; j < n; j += DECODE_THREADS) {
    const int pos = start + j;
    const T* k_row = k_cache + (static_cast<long long>(table[pos / block_size]) * num_kv_heads + kv_head) * tile +
                     static_cast<long long>(pos % block_size) * D;
    for (int g0 = 0; g0 < group; g0 += GC) {
      float acc[GC];
#pragma unroll
      for (int g = 0; g < GC; ++g) acc[g] = 0.0f;
      for (int d = 0; d < D; d += VEC) {
        const VecOf<T> kv = load_vec(k_row + d);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float k = to_float(kv.v[e]);
#pragma unroll
          for (int g = 0; g < GC; ++g) {
            if (g0 + g < group) acc[g] += q_s[(g0 + g) * D + d + e] * k;
          }
        }
      }
#pragma unroll
      for (int g = 0; g < GC; ++g) {
        if (g0 + g < group) p_s[(g0 + g) * partition_size + j] = acc[g];
      }
    }
  }
  __syncthreads();

  // Phase 2: per head, max and sum of exp over this split; p_s becomes exp(s - m).
  for (int g = warp; g < group; g += DECODE_THREADS / 32) {
    float* p = p_s + g * partition_size;
    float m = neg_inf();
    for (int j = lane; j < n; j += 32) m = fmaxf(m, p[j]);
    m = warp_max(m);
    float l = 0.0f;
    for (int j = lane; j < n; j += 32) {
      const float e = expf(p[j] - m);
      p[j] = e;
      l += e;
    }
    l = warp_sum(l);
    if (lane == 0) {
      const long long stat = (static_cast<long long>(seq) * num_heads + kv_head * group + g) * num_splits + split;
      part_max[stat] = m;
      part_sum[stat] = l;
    }
  }
  __syncthreads();

  // Phase 3: o[g] = sum_j p[g, j] * v_j, GC heads per pass.
  const int chunks = D / VEC;                  // 16-byte slices per row
  const int groups = DECODE_THREADS / chunks;  // NG token groups
  const int tgroup = tid / chunks;
  const int chunk = tid - tgroup * chunks;
  for (int g0 = 0; g0 < group; g0 += GC) {
    if (tgroup < groups) {
      float acc[GC][VEC];
#pragma unroll
      for (int g = 0; g < GC; ++g)
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[g][e] = 0.0f;
      for (int j = tgroup; j < n; j += groups) {
        const int pos = start + j;
        const T* v_row = v_cache + (static_cast<long long>(table[pos / block_size]) * num_kv_heads + kv_head) * tile +
                         static_cast<long long>(pos % block_size) * D;
        const VecOf<T> vv = load_vec(v_row + chunk * VEC);
#pragma unroll
        for (int g = 0; g < GC; ++g) {
          if (g0 + g < group) {
            const float p = p_s[(g0 + g) * partition_size + j];
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[g][e] += p * to_float(vv.v[e]);
          }
        }
      }
#pragma unroll
      for (int g = 0; g < GC; ++g)
#pragma unroll
        for (int e = 0; e < VEC; ++e) red_s[(tgroup * GC + g) * D + chunk * VEC + e] = acc[g][e];
    }
    __syncthreads();
    for (int i = tid; i < GC * D; i += DECODE_THREADS) {
      const int g = i / D;
      const int d = i - g * D;
      if (g0 + g < group) {
        float o = 0.0f;
        for (int t = 0; t < groups; ++t) o += red_s[(t * GC + g) * D + d];
        const long long stat = (static_cast<long long>(seq) * num_heads + kv_head * group + g0 + g) * num_splits + split;
        part_out[stat * D + d] = o;
      }
    }
    __syncthreads();
  }
}

template <typename T>
__global__ void __launch_bounds__(1024) paged_attention_merge_kernel(
    T* __restrict__ out, const float* __restrict__ part_out, const float* __restrict__ part_max,
    const float* __restrict__ part_sum, const int* __restrict__ context_lens,
    const int* __restrict__ query_start_loc, int num_heads, int head_dim, int partition_size, int num_splits,
    int window) {
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int ctx = context_lens[seq];
  const int first = window > 0 ? imax(0, ctx - window) : 0;
  const int used = imin(ceil_div(ctx - first, partition_size), num_splits);
  const long long stat = (static_cast<long long>(seq) * num_heads + head) * num_splits;
  float m = neg_inf();
  for (int s = 0; s < used; ++s) m = fmaxf(m, part_max[stat + s]);
  float denom = 0.0f;
  for (int s = 0; s < used; ++s) denom += expf(part_max[stat + s] - m) * part_sum[stat + s];
  const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
  T* dst = out + static_cast<long long>(query_start_loc[seq]) * num_heads * head_dim +
           static_cast<long long>(head) * head_dim;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float o = 0.0f;
    for (int s = 0; s < used; ++s) o += expf(part_max[stat + s] - m) * part_out[(stat + s) * head_dim + d];
    dst[d] = from_float<T>(o * inv);
  }
}
