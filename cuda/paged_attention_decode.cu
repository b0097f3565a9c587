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
//   template <T, GC>: storage type; query heads served by one read of a K or V row (GC x VEC registers
//   of accumulators).  The backend runs GC = 8; GC = 4 (two walks over the rows for G = 8) is kept as
//   the baseline tools/gpu_decode_bench.py times against.
//   grid (S, Hkv, B), block (128, 1, 1).  Block (s, h, b) covers positions
//   [first + s * P, min(first + (s+1) * P, ctx)) of sequence b for KV head h and ALL G = H / Hkv query
//   heads that share it: each K/V row is fetched from memory once per step, not G times.
//   P = decode_split_len(ctx - first): each sequence's own split length, about (ctx - first) /
//   target_splits, so a long context spreads over many blocks whatever the batch.  S is a host-side bound
//   on every sequence's ceil((ctx - first) / P) (CUDABackend.decode_splits); blocks past a sequence's
//   context return at once, so the grid may be sized for the longest context the engine allows (what a
//   captured CUDA graph needs).
//   Dynamic shared memory, floats:  q_s [G, D] | p_s [G, Pmax] | red_s [NG, GR, D]  (Pmax = max_partition)
//   Three phases:
//     1. scores: thread j takes positions j, j + 128, ...; it streams its K row in 16-byte vectors and
//        dots each vector with GC (pre-scaled) queries held in shared memory (all lanes read the
//        same query element: a broadcast).  No shuffles: a warp reads 32 rows side by side.
//     2. softmax statistics: warp w reduces heads w, w + 4, ...: max, exp, sum (warp shuffles).
//     3. P.V: the 128 threads form NG = 128 / (D / VEC) token groups of D / VEC threads; each thread owns
//        one 16-byte slice of the output for GC heads at once (GC x VEC float accumulators) and walks
//        the group's positions; the groups' partial sums meet in red_s, GR = 4 heads per round.
//   With G <= GC = 8 (every GQA ratio of the supported families: 1 ... 8) each K and each V element of
//   the split is loaded by exactly one thread, once; a larger G walks the rows again per GC heads.
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
#define DECODE_REDUCE_HEADS 4    // GR: query heads per round of phase 3's reduction through red_s
// Resident blocks per SM the register allocation must allow (<= 128 registers a thread).  Without it
// ptxas may pick 64 registers for the float instantiation and spill phase 3's accumulators.
#define DECODE_MIN_BLOCKS 4

// Positions per split of a sequence whose query sees `span` positions: about span / target_splits in
// whole KV blocks, within [min_partition, max_partition] (whole blocks, min <= max).  A function of the
// sequence's own span only, so its splits, and the rounding of its result, never depend on the rest of
// the batch; both kernels compute it the same way.  CUDABackend.decode_split_len is the same rule.
RAWINFER_DEVICE int decode_split_len(int span, int block_size, int min_partition, int max_partition,
                                     int target_splits) {
  const int len = ceil_div(ceil_div(span, target_splits), block_size) * block_size;
  return imin(max_partition, imax(min_partition, len));
}

template <typename T, int GC>
__global__ void __launch_bounds__(DECODE_THREADS, DECODE_MIN_BLOCKS) paged_attention_decode_kernel(
    float* __restrict__ part_out, float* __restrict__ part_max, float* __restrict__ part_sum,
    const T* __restrict__ qkv, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
    const int* __restrict__ block_tables, const int* __restrict__ context_lens,
    const int* __restrict__ query_start_loc, float scale, int num_heads, int num_kv_heads, int head_dim,
    int block_size, int max_blocks_per_seq, int min_partition, int max_partition, int target_splits,
    int num_splits, int window) {
  constexpr int VEC = VecOf<T>::N;
  constexpr int GR = DECODE_REDUCE_HEADS;
  const int split = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int seq = blockIdx.z;
  const int ctx = context_lens[seq];
  const int first = window > 0 ? imax(0, ctx - window) : 0;  // the query's first visible position
  const int partition_size = decode_split_len(ctx - first, block_size, min_partition, max_partition, target_splits);
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
  float* red_s = p_s + group * max_partition;  // [NG, GR, D]

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
        if (g0 + g < group) p_s[(g0 + g) * max_partition + j] = acc[g];
      }
    }
  }
  __syncthreads();

  // Phase 2: per head, max and sum of exp over this split; p_s becomes exp(s - m).
  for (int g = warp; g < group; g += DECODE_THREADS / 32) {
    float* p = p_s + g * max_partition;
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

  // Phase 3: o[g] = sum_j p[g, j] * v_j.  Each V slice is loaded once for GC heads (all of them when
  // G <= GC); the token groups' partial sums then meet in red_s, GR heads per round.
  const int chunks = D / VEC;                  // 16-byte slices per row
  const int groups = DECODE_THREADS / chunks;  // NG token groups
  const int tgroup = tid / chunks;
  const int chunk = tid - tgroup * chunks;
  for (int g0 = 0; g0 < group; g0 += GC) {
    float acc[GC][VEC];
#pragma unroll
    for (int g = 0; g < GC; ++g)
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[g][e] = 0.0f;
    if (tgroup < groups) {
      for (int j = tgroup; j < n; j += groups) {
        const int pos = start + j;
        const T* v_row = v_cache + (static_cast<long long>(table[pos / block_size]) * num_kv_heads + kv_head) * tile +
                         static_cast<long long>(pos % block_size) * D;
        const VecOf<T> vv = load_vec(v_row + chunk * VEC);
        float v[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) v[e] = to_float(vv.v[e]);
#pragma unroll
        for (int g = 0; g < GC; ++g) {
          if (g0 + g < group) {
            const float p = p_s[(g0 + g) * max_partition + j];
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[g][e] += p * v[e];
          }
        }
      }
    }
    // NOTE: the rounds are unrolled so that acc is indexed by constants and stays in registers.
#pragma unroll
    for (int r = 0; r < GC; r += GR) {
      if (g0 + r < group) {  // uniform across the block: no thread skips a barrier another one reaches
        if (tgroup < groups) {
#pragma unroll
          for (int g = 0; g < GR; ++g)
#pragma unroll
            for (int e = 0; e < VEC; ++e) red_s[(tgroup * GR + g) * D + chunk * VEC + e] = acc[r + g][e];
        }
        __syncthreads();
        for (int i = tid; i < GR * D; i += DECODE_THREADS) {
          const int g = i / D;
          const int d = i - g * D;
          const int head = g0 + r + g;
          if (head < group) {
            float o = 0.0f;
            for (int t = 0; t < groups; ++t) o += red_s[(t * GR + g) * D + d];
            const long long stat = (static_cast<long long>(seq) * num_heads + kv_head * group + head) * num_splits + split;
            part_out[stat * D + d] = o;
          }
        }
        __syncthreads();
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(1024) paged_attention_merge_kernel(
    T* __restrict__ out, const float* __restrict__ part_out, const float* __restrict__ part_max,
    const float* __restrict__ part_sum, const int* __restrict__ context_lens,
    const int* __restrict__ query_start_loc, int num_heads, int head_dim, int block_size, int min_partition,
    int max_partition, int target_splits, int num_splits, int window) {
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int ctx = context_lens[seq];
  const int first = window > 0 ? imax(0, ctx - window) : 0;
  const int partition_size = decode_split_len(ctx - first, block_size, min_partition, max_partition, target_splits);
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
