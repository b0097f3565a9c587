// paged_attention_prefill.cu: causal attention for prefill and mixed batches (any number of query
// tokens per sequence), reading K/V only through the block tables, with an online softmax.
//
// Layouts (row-major, C-contiguous):
//   qkv               [T, (H + 2*Hkv) * D]  T      queries of sequence b: rows query_start_loc[b] ...
//                                                  query_start_loc[b+1] - 1, query head h at columns h * D
//   k_cache, v_cache  [NB, Hkv, BS, D]      T      (this step's K/V already written by kv_write)
//   block_tables      [B, MB]               int32
//   context_lens      [B]                   int32  cached tokens after this step; the q_len queries of b
//                                                  sit at positions ctx - q_len ... ctx - 1
//   query_start_loc   [B + 1]               int32
//   out               [T, H * D]            T
//
// Launch: grid (ceil(max_query_len / 16), H, B), block (128, 1, 1).
//   Block (qt, h, b) owns query rows qt*16 ... qt*16 + 15 of sequence b for query head h (KV head
//   h / (H / Hkv)); blocks past the sequence's q_len return at once.  Thread layout: 16 rows x 8 lanes;
//   the 8 lanes of a row are consecutive lanes of one warp, so row-wise reductions are 3 xor-shuffles.
//   It walks key tiles of BK = kv_tile positions (32, 16 or 8, chosen by the host to fit 48 KiB)
//   from the first position any of its rows may see up to the last one (causal), gathering each tile's
//   rows through the block table into shared memory:
//
//     q_s [16, D+1] float (pre-scaled)  k_s [BK, D + pad] T   v_s [BK, D + pad] T   p_s [16, BK] float
//
//   Per tile, lane c of row r computes scores for keys c, c+8, ... (a full dot product each, from
//   shared memory), the row's running max m and rescale factor alpha = exp(m_old - m_new) follow from a
//   shuffle max, and each lane keeps D/8 output accumulators (dims c, c+8, ...) in registers:
//   acc = acc * alpha + sum_k p_k v_k.  The row sum l is kept per lane and summed once at the end.
//   The pad of one 32-bit word per K/V row keeps the 8 lanes' reads of 8 different rows in 8 banks.
//
// Sliding window: window W > 0 means the query at position p sees keys p - W + 1 ... p only (W = 0: all
// keys up to p).  The block's first row sees the earliest keys, so its walk starts at
// kv_begin = max(0, past + row0 - W + 1): positions before it are visible to no row of the block and
// are never read, nor are their block table entries, which may be stale (the scheduler may free blocks
// that slid out of the window of the chunk's first query).  Inside the walk each row masks the keys
// before its own window like the keys after its position.
//
// NOTE: plain float FMAs, no tensor cores: simple and exact enough for every D <= 256.
// Requirements checked by the host: D <= 256, H a multiple of Hkv, kv_tile in {8, 16, 32}.
#include "common.cuh"

#define PREFILL_ROWS 16
#define PREFILL_LANES 8
#define PREFILL_THREADS (PREFILL_ROWS * PREFILL_LANES)
#define PREFILL_MAX_D 256
#define PREFILL_MAX_TILE 32

template <typename T>
__global__ void __launch_bounds__(PREFILL_THREADS, 1) paged_attention_prefill_kernel(
    T* __restrict__ out, const T* __restrict__ qkv, const T* __restrict__ k_cache,
    const T* __restrict__ v_cache, const int* __restrict__ block_tables, const int* __restrict__ context_lens,
    const int* __restrict__ query_start_loc, float scale, int num_heads, int num_kv_heads, int head_dim,
    int block_size, int max_blocks_per_seq, int kv_tile, int window) {
  constexpr int DIMS_PER_LANE = PREFILL_MAX_D / PREFILL_LANES;       // 32 accumulators at most
  constexpr int KEYS_PER_LANE = PREFILL_MAX_TILE / PREFILL_LANES;    // 4 scores at most
  const int head = blockIdx.y;
  const int seq = blockIdx.z;
  const int q_first = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - q_first;
  const int row0 = blockIdx.x * PREFILL_ROWS;
  if (row0 >= q_len) return;  // the whole block leaves together

  const int D = head_dim;
  const int BK = kv_tile;
  const int ctx = context_lens[seq];
  const int past = ctx - q_len;  // query i sits at position past + i
  const int kv_head = head / (num_heads / num_kv_heads);
  const int tid = threadIdx.x;
  const int r = tid / PREFILL_LANES;
  const int c = tid % PREFILL_LANES;
  const bool row_active = row0 + r < q_len;
  const int q_pos = past + row0 + r;
  const int q_lo = window > 0 ? q_pos - window + 1 : 0;  // the row's first visible key
  const int kv_begin = window > 0 ? imax(0, past + row0 - window + 1) : 0;
  const int kv_end = past + imin(row0 + PREFILL_ROWS, q_len);  // keys [kv_begin, kv_end) are visible to some row
  const long long row_len = static_cast<long long>(num_heads + 2 * num_kv_heads) * D;
  const int* table = block_tables + static_cast<long long>(seq) * max_blocks_per_seq;
  const long long tile_stride = static_cast<long long>(block_size) * D;
  const int q_stride = D + 1;
  const int kv_stride = D + 4 / static_cast<int>(sizeof(T));  // one 32-bit word of padding

  DYNAMIC_SHARED(float, smem);
  float* q_s = smem;                                                // [16, D + 1]
  float* p_s = q_s + PREFILL_ROWS * q_stride;                       // [16, BK]
  T* k_s = reinterpret_cast<T*>(p_s + PREFILL_ROWS * PREFILL_MAX_TILE);  // [BK, kv_stride]
  T* v_s = k_s + BK * kv_stride;                                    // [BK, kv_stride]

  for (int i = tid; i < PREFILL_ROWS * D; i += PREFILL_THREADS) {
    const int rr = i / D;
    const int d = i - rr * D;
    float q = 0.0f;
    if (row0 + rr < q_len) {
      q = to_float(qkv[static_cast<long long>(q_first + row0 + rr) * row_len + static_cast<long long>(head) * D + d]);
    }
    q_s[rr * q_stride + d] = q * scale;
  }

  float acc[DIMS_PER_LANE];
#pragma unroll
  for (int i = 0; i < DIMS_PER_LANE; ++i) acc[i] = 0.0f;
  float m_run = neg_inf();
  float l_lane = 0.0f;  // this lane's share of the row's sum of exp

  for (int k0 = kv_begin; k0 < kv_end; k0 += BK) {
    __syncthreads();  // the previous tile is no longer read (and, the first time, q_s is written)
    for (int i = tid; i < BK * D; i += PREFILL_THREADS) {
      const int j = i / D;
      const int d = i - j * D;
      const int pos = k0 + j;
      T k = from_float<T>(0.0f);
      T v = k;
      if (pos < kv_end) {
        const long long at = (static_cast<long long>(table[pos / block_size]) * num_kv_heads + kv_head) * tile_stride +
                             static_cast<long long>(pos % block_size) * D + d;
        k = k_cache[at];
        v = v_cache[at];
      }
      k_s[j * kv_stride + d] = k;
      v_s[j * kv_stride + d] = v;
    }
    __syncthreads();

    float s[KEYS_PER_LANE];
    float m_tile = neg_inf();
#pragma unroll
    for (int jj = 0; jj < KEYS_PER_LANE; ++jj) {
      s[jj] = neg_inf();
      const int j = c + PREFILL_LANES * jj;
      if (j < BK && row_active && k0 + j <= q_pos && k0 + j >= q_lo) {
        const float* q = q_s + r * q_stride;
        const T* k = k_s + j * kv_stride;
        float dot = 0.0f;
        for (int d = 0; d < D; ++d) dot += q[d] * to_float(k[d]);
        s[jj] = dot;
        m_tile = fmaxf(m_tile, dot);
      }
    }
    m_tile = fmaxf(m_tile, __shfl_xor_sync(RAWINFER_FULL_MASK, m_tile, 4));
    m_tile = fmaxf(m_tile, __shfl_xor_sync(RAWINFER_FULL_MASK, m_tile, 2));
    m_tile = fmaxf(m_tile, __shfl_xor_sync(RAWINFER_FULL_MASK, m_tile, 1));
    const float m_new = fmaxf(m_run, m_tile);
    // A row that has seen no visible key yet (m_new = -inf) keeps alpha = 1 and adds nothing.
    const bool any = m_new != neg_inf();
    const float alpha = any ? expf(m_run - m_new) : 1.0f;
    float l_tile = 0.0f;
#pragma unroll
    for (int jj = 0; jj < KEYS_PER_LANE; ++jj) {
      const int j = c + PREFILL_LANES * jj;
      if (j < BK) {
        const float p = (any && s[jj] != neg_inf()) ? expf(s[jj] - m_new) : 0.0f;
        p_s[r * PREFILL_MAX_TILE + j] = p;
        l_tile += p;
      }
    }
    l_lane = l_lane * alpha + l_tile;
    m_run = m_new;
    __syncwarp();  // p_s row r is written and read by the same 8 lanes of one warp

#pragma unroll
    for (int i = 0; i < DIMS_PER_LANE; ++i) acc[i] *= alpha;
    for (int j = 0; j < BK; ++j) {
      const float p = p_s[r * PREFILL_MAX_TILE + j];
      const T* v = v_s + j * kv_stride;
#pragma unroll
      for (int i = 0; i < DIMS_PER_LANE; ++i) {
        const int d = c + PREFILL_LANES * i;
        if (d < D) acc[i] += p * to_float(v[d]);
      }
    }
  }

  float l = l_lane;
  l += __shfl_xor_sync(RAWINFER_FULL_MASK, l, 4);
  l += __shfl_xor_sync(RAWINFER_FULL_MASK, l, 2);
  l += __shfl_xor_sync(RAWINFER_FULL_MASK, l, 1);
  if (row_active) {
    const float inv = 1.0f / l;  // l >= 1: the row's own position is always visible
    T* dst = out + static_cast<long long>(q_first + row0 + r) * num_heads * D + static_cast<long long>(head) * D;
#pragma unroll
    for (int i = 0; i < DIMS_PER_LANE; ++i) {
      const int d = c + PREFILL_LANES * i;
      if (d < D) dst[d] = from_float<T>(acc[i] * inv);
    }
  }
}
