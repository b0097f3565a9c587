// flash_attention_prefill.cu: causal attention for prefill and mixed batches on tensor cores, in the
// manner of FlashAttention-2: mma.sync m16n8k16 (f16 / bf16 in, float32 accumulate) for Q K^T and P V,
// K/V tiles gathered through the block tables into shared memory with cp.async, an online softmax in
// float32.  The same argument list and results as paged_attention_prefill.cu, which the host keeps for
// float32 and for head dimensions this kernel is not built for.
//
// Layouts (row-major, C-contiguous), as in paged_attention_prefill.cu:
//   qkv               [T, (H + 2*Hkv) * D]  T      queries of sequence b: rows query_start_loc[b] ...
//                                                  query_start_loc[b+1] - 1, query head h at columns h * D
//   k_cache, v_cache  [NB, Hkv, BS, D]      T      (this step's K/V already written by kv_write)
//   block_tables      [B, MB]               int32
//   context_lens      [B]                   int32  the q_len queries of b sit at positions ctx - q_len ... ctx - 1
//   query_start_loc   [B + 1]               int32
//   out               [T, H * D]            T
// head_dim must equal the template's D and kv_tile the tile BK below (the host passes both, so the
// argument list is paged_attention_prefill's).
//
// Launch: grid (ceil(max_query_len * G / 64), Hkv, B), G = H / Hkv, block (128, 1, 1), dynamic shared memory
// 2 * BK * (D + 8) * sizeof(T) + 64 * sizeof(FlashRow).  The G query heads that share a KV head are packed into the rows of one
// tile (as FlashInfer and FlashAttention's pack-GQA do): packed row r of sequence b and KV head kh is query
// r / G of query head kh * G + r % G, so every K/V tile a block loads serves all G heads, and a decode
// row of a mixed step fills G rows instead of one.  Block (x, kh, b) owns packed rows qt*64 ... qt*64 + 63
// (qt = gridDim.x - 1 - x); blocks past the sequence's q_len * G rows return at once.  Warp w owns 16 of
// those rows, the M of one m16n8k16 tile, and keeps them in registers for the whole walk:
//
//   Q  as A fragments   qa[D/16][4]   (16 rows x D, loaded once from global memory; D = 256: per k-step)
//   S  = Q K^T          s[BK/8][4]    float accumulators of 16 x BK scores
//   P  as A fragments   pa[BK/16][4]  the scores' registers reused: S's accumulator layout is A's
//   O  accumulators     o[D/8][4]     16 x D, rescaled by alpha = 2^(m_old - m_new) per tile
//
// Lane l holds rows g = l / 4 and g + 8 of its warp's 16; the four lanes of a row reduce its max and
// sum with two xor-shuffles.  Scores are kept in log2 units (scale * log2(e) folded in), so exp is exp2.
//
// Key tiles: BK positions (64, or 32 for D = 256, so that Q, S and O stay in registers) from the first
// position any row of the block may see to the last one (causal; the block's queries are r / G for its
// packed rows r), in shared memory as
//
//   k_s [BK, D + 8] T      v_s [BK, D + 8] T      rows_s [64] FlashRow (each packed row's query and
//                                                  output offsets and position, written once)
//
// the 8-element pad putting the 8 rows one ldmatrix phase reads in 8 different bank groups.  K rows
// are [key][d], read with ldmatrix as the B fragments of Q K^T; V rows are [key][d] too, read with
// ldmatrix.trans as the B fragments of P V.  Each 16-byte chunk of a row arrives by cp.async, looked up
// through the block table; positions past the block's last visible key are zero-filled and their table
// entries never read.  The loads overlap the math in FlashAttention-2's order:
//
//   K(0) in flight
//   per tile j:  issue V(j) | wait K(j) | S = Q K(j)^T | issue K(j+1) | softmax | wait V(j) | O += P V(j)
//
// so one buffer each for K and V suffices: K(j+1) overwrites k_s only after every warp has read K(j),
// and V(j+1) v_s only after every warp has read V(j) (the barriers in the loop).
//
// Masking: a key at position k is visible to the query at position p when k <= p and, with a sliding
// window W > 0, k > p - W.  The walk starts at kv_begin = max(0, past + row0 / G - W + 1) (W > 0): keys
// before it are visible to no row of the block and neither they nor their block table entries (which
// may be stale) are read.  A warp whose rows see nothing of a tile skips its math for that tile (warp-
// uniform: every lane of a warp takes the same branch); the mask itself is applied only on tiles that
// are not wholly visible to all the warp's rows.
//
// P is rounded to T before P V (the tensor cores take f16 / bf16), as FlashAttention does; the row sum l
// adds the rounded values, so the weights that multiply V are exactly the ones normalised.
//
// Requirements checked by the host: T f16 or bf16, D one of the instantiated head dims (multiples of
// 16), H a multiple of Hkv, k_cache and v_cache 16-byte aligned, qkv and out 4-byte aligned (Q is read
// and O written two elements at a time).
#include "common.cuh"

#define FLASH_WARPS 4
#define FLASH_THREADS (FLASH_WARPS * 32)
#define FLASH_ROWS (FLASH_WARPS * 16)
#define FLASH_PAD 8

template <int D>
struct FlashTile {
  static constexpr int BK = D <= 128 ? 64 : 32;   // key positions per tile
  static constexpr int STRIDE = D + FLASH_PAD;    // shared memory row stride, elements
  static constexpr int CHUNKS = D / 8;            // 16-byte chunks per row
  // Q's fragments stay in registers up to D = 128; at D = 256 they (64 registers) would push O and S
  // into local memory, so each k-step reloads its 4 from global memory (the block's 64 Q rows stay in
  // L1/L2 across the walk).
  static constexpr bool Q_IN_REGS = D <= 128;
  static constexpr int Q_STEPS = Q_IN_REGS ? D / 16 : 1;
};

// The A fragment of k-step kk of a warp's 16 query rows (q0: row g, q1: row g + 8; zeros past q_len).
template <typename T>
RAWINFER_DEVICE void flash_q_fragment(unsigned (&qa)[4], const T* q0, const T* q1, bool has0, bool has1, int kk,
                                      int c) {
  const int d = kk * 16 + 2 * c;
  qa[0] = has0 ? load_pair(q0 + d) : 0u;
  qa[1] = has1 ? load_pair(q1 + d) : 0u;
  qa[2] = has0 ? load_pair(q0 + d + 8) : 0u;
  qa[3] = has1 ? load_pair(q1 + d + 8) : 0u;
}

// Where packed row r (query r / G of head kv_head * G + r % G) starts in a [T, row_len] array whose head
// h sits at columns h * D; row 0, head 0 for a row past the end (has = false), which is never read.
RAWINFER_DEVICE long long flash_row_offset(bool has, int r, int group, int q_first, int kv_head, long long row_len,
                                           int d) {
  if (!has) return 0;
  return (q_first + r / group) * row_len + static_cast<long long>(kv_head * group + r % group) * d;
}

// One packed row of a block: where its query starts in qkv and its output in out, and its position.  The
// block's 64 live in shared memory, filled once, so that the walk's registers hold accumulators only.
struct FlashRow {
  long long q_offset;    // elements into qkv
  long long out_offset;  // elements into out
  int pos;               // the query's position in its sequence
  int valid;             // 0: a row past the sequence's end (offsets 0, never read or written)
};

// How a position splits into (logical block, row in block): a shift and a mask when the block size is a
// power of two (the usual 16), else a division.
struct FlashBlocks {
  int size;
  int shift;  // log2(size), or -1
};

RAWINFER_DEVICE FlashBlocks flash_blocks(int block_size) {
  FlashBlocks b = {block_size, -1};
  if ((block_size & (block_size - 1)) == 0) {
    for (b.shift = 0; (1 << b.shift) < block_size;) ++b.shift;
  }
  return b;
}

// One K or V tile of BK positions starting at k0 into shared memory (cp.async, uncommitted): thread t
// copies chunks t, t + 128, ... of the tile's BK * D / 8.
template <typename T, int D>
RAWINFER_DEVICE void flash_load_tile(T* tile, const T* cache, const int* table, int k0, int kv_end, int kv_head,
                                     int num_kv_heads, FlashBlocks blocks) {
  constexpr int BK = FlashTile<D>::BK;
  constexpr int CHUNKS = FlashTile<D>::CHUNKS;
  for (int i = threadIdx.x; i < BK * CHUNKS; i += FLASH_THREADS) {
    const int j = i / CHUNKS;
    const int chunk = i - j * CHUNKS;
    const int pos = k0 + j;
    const bool valid = pos < kv_end;
    const T* src = cache;
    if (valid) {
      const int logical = blocks.shift >= 0 ? pos >> blocks.shift : pos / blocks.size;
      const int row = pos - logical * blocks.size;
      const long long blk = table[logical];
      src = cache + ((blk * num_kv_heads + kv_head) * blocks.size + row) * D + chunk * 8;
    }
    cp_async_16(tile + j * FlashTile<D>::STRIDE + chunk * 8, src, valid);
  }
}

// S = Q K^T for one warp's 16 rows and the BK keys of k_s (log2-scaled by the caller).
template <typename T, int D>
RAWINFER_DEVICE void flash_scores(float (&s)[FlashTile<D>::BK / 8][4],
                                  const unsigned (&q_regs)[FlashTile<D>::Q_STEPS][4], const T* qkv,
                                  const FlashRow* warp_rows, const T* k_s, int lane) {
  constexpr int BK = FlashTile<D>::BK;
  const int mat = lane / 8;
  const int r = lane % 8;
  const FlashRow& row0 = warp_rows[lane / 4];
  const FlashRow& row1 = warp_rows[lane / 4 + 8];
#pragma unroll
  for (int nt = 0; nt < BK / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    unsigned qa[4];
    if constexpr (FlashTile<D>::Q_IN_REGS) {
#pragma unroll
      for (int i = 0; i < 4; ++i) qa[i] = q_regs[kk][i];
    } else {
      flash_q_fragment(qa, qkv + row0.q_offset, qkv + row1.q_offset, row0.valid, row1.valid, kk, lane % 4);
    }
#pragma unroll
    for (int np = 0; np < BK / 16; ++np) {
      // matrices: keys np*16 + (0..7 | 8..15) x dims kk*16 + (0..7 | 8..15); lane -> (key, dim) row address
      unsigned kb[4];
      ldmatrix_x4(kb, k_s + (np * 16 + (mat / 2) * 8 + r) * FlashTile<D>::STRIDE + kk * 16 + (mat % 2) * 8);
      const unsigned b0[2] = {kb[0], kb[1]};
      const unsigned b1[2] = {kb[2], kb[3]};
      mma_m16n8k16<T>(s[2 * np], qa, b0);
      mma_m16n8k16<T>(s[2 * np + 1], qa, b1);
    }
  }
}

// O += P V for one warp's 16 rows and the BK keys of v_s.
template <typename T, int D>
RAWINFER_DEVICE void flash_accumulate(float (&o)[D / 8][4], const unsigned (&pa)[FlashTile<D>::BK / 16][4],
                                      const T* v_s, int lane) {
  constexpr int BK = FlashTile<D>::BK;
  const int mat = lane / 8;
  const int r = lane % 8;
#pragma unroll
  for (int kj = 0; kj < BK / 16; ++kj) {
#pragma unroll
    for (int np = 0; np < D / 16; ++np) {
      // matrices: keys kj*16 + (0..7 | 8..15) x dims np*16 + (0..7 | 8..15), transposed into B fragments
      unsigned vb[4];
      ldmatrix_x4_trans(vb, v_s + (kj * 16 + (mat % 2) * 8 + r) * FlashTile<D>::STRIDE + np * 16 + (mat / 2) * 8);
      const unsigned b0[2] = {vb[0], vb[1]};
      const unsigned b1[2] = {vb[2], vb[3]};
      mma_m16n8k16<T>(o[2 * np], pa[kj], b0);
      mma_m16n8k16<T>(o[2 * np + 1], pa[kj], b1);
    }
  }
}

// The row max over the 4 lanes that share a row.
RAWINFER_DEVICE float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(RAWINFER_FULL_MASK, v, 1));
  return fmaxf(v, __shfl_xor_sync(RAWINFER_FULL_MASK, v, 2));
}

RAWINFER_DEVICE float quad_sum(float v) {
  v += __shfl_xor_sync(RAWINFER_FULL_MASK, v, 1);
  return v + __shfl_xor_sync(RAWINFER_FULL_MASK, v, 2);
}

// The online softmax of a lane's two rows (g and g + 8): the running maxima (log2 units) and this lane's
// share of the row sums.
struct FlashSoftmax {
  float m0, m1;
  float l0, l1;
};

// One tile's softmax step for a warp: scale S to log2 units and mask it (masked: keys after a row's
// position pos0 / pos1 or before its window), update the running maxima and sums, rescale O by
// alpha = 2^(m_old - m_new), and return P = 2^(S - m_new) rounded to T as the A fragments of P V.
template <typename T, int D>
RAWINFER_DEVICE void flash_softmax(unsigned (&pa)[FlashTile<D>::BK / 16][4], float (&s)[FlashTile<D>::BK / 8][4],
                                   float (&o)[D / 8][4], FlashSoftmax& st, float scale_log2, int k0, int c,
                                   bool masked, int pos0, int pos1, int window) {
  constexpr int BK = FlashTile<D>::BK;
  float mx0 = st.m0, mx1 = st.m1;
#pragma unroll
  for (int nt = 0; nt < BK / 8; ++nt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float v = s[nt][i] * scale_log2;
      if (masked) {
        const int key = k0 + nt * 8 + 2 * c + (i & 1);
        const int pos = i < 2 ? pos0 : pos1;
        if (key > pos || (window > 0 && key <= pos - window)) v = neg_inf();
      }
      s[nt][i] = v;
    }
    mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
    mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
  }
  mx0 = quad_max(mx0);
  mx1 = quad_max(mx1);
  // A row that has seen no visible key yet (max -inf) keeps alpha = 1 and adds nothing.
  const bool any0 = mx0 != neg_inf();
  const bool any1 = mx1 != neg_inf();
  const float alpha0 = any0 ? exp2f(st.m0 - mx0) : 1.0f;
  const float alpha1 = any1 ? exp2f(st.m1 - mx1) : 1.0f;
  st.m0 = mx0;
  st.m1 = mx1;
  float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
  for (int nt = 0; nt < BK / 8; ++nt) {
    const T p0 = from_float<T>(any0 ? exp2f(s[nt][0] - mx0) : 0.0f);
    const T p1 = from_float<T>(any0 ? exp2f(s[nt][1] - mx0) : 0.0f);
    const T p2 = from_float<T>(any1 ? exp2f(s[nt][2] - mx1) : 0.0f);
    const T p3 = from_float<T>(any1 ? exp2f(s[nt][3] - mx1) : 0.0f);
    sum0 += to_float(p0) + to_float(p1);
    sum1 += to_float(p2) + to_float(p3);
    pa[nt / 2][(nt % 2) * 2] = pack2(p0, p1);      // row g:     keys 2c, 2c+1 (+8 for odd nt)
    pa[nt / 2][(nt % 2) * 2 + 1] = pack2(p2, p3);  // row g + 8
  }
  st.l0 = st.l0 * alpha0 + sum0;
  st.l1 = st.l1 * alpha1 + sum1;
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
    o[nt][0] *= alpha0;
    o[nt][1] *= alpha0;
    o[nt][2] *= alpha1;
    o[nt][3] *= alpha1;
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(FLASH_THREADS, 1) flash_attention_prefill_kernel(
    T* __restrict__ out, const T* __restrict__ qkv, const T* __restrict__ k_cache,
    const T* __restrict__ v_cache, const int* __restrict__ block_tables, const int* __restrict__ context_lens,
    const int* __restrict__ query_start_loc, float scale, int num_heads, int num_kv_heads, int head_dim,
    int block_size, int max_blocks_per_seq, int kv_tile, int window) {
  constexpr int BK = FlashTile<D>::BK;
  const int kv_head = blockIdx.y;
  const int seq = blockIdx.z;
  const int group = num_heads / num_kv_heads;
  const int q_first = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - q_first;
  const int rows = q_len * group;  // packed rows (query i, head kv_head * G + j) at i * G + j
  // The last query tiles of a causal prompt walk the most keys: they get the lowest block indices, so
  // the GPU starts the long blocks first and the short ones fill in behind them.
  const int row0 = (gridDim.x - 1 - blockIdx.x) * FLASH_ROWS;
  if (row0 >= rows) return;  // the whole block leaves together

  const int ctx = context_lens[seq];
  const int past = ctx - q_len;  // query i sits at position past + i
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;
  const int c = lane % 4;
  const int kv_begin = window > 0 ? imax(0, past + row0 / group - window + 1) : 0;
  const int kv_end = past + (imin(row0 + FLASH_ROWS, rows) - 1) / group + 1;  // keys [kv_begin, kv_end) are
                                                                              // visible to some row of the block
  const int* table = block_tables + static_cast<long long>(seq) * max_blocks_per_seq;
  const FlashBlocks blocks = flash_blocks(block_size);
  const long long row_len = static_cast<long long>(num_heads + 2 * num_kv_heads) * D;

  const int wrow0 = row0 + warp * 16;                  // the warp's first packed row
  const bool warp_active = wrow0 < rows;
  const int w_first = past + wrow0 / group;            // positions of its first and last query
  const int w_last = past + imin(wrow0 + 15, rows - 1) / group;

  DYNAMIC_SHARED(T, smem);
  T* k_s = smem;                                                               // [BK, D + 8]
  T* v_s = smem + BK * FlashTile<D>::STRIDE;                                   // [BK, D + 8]
  FlashRow* rows_s = reinterpret_cast<FlashRow*>(v_s + BK * FlashTile<D>::STRIDE);  // [64]
  const FlashRow* warp_rows = rows_s + warp * 16;

  flash_load_tile<T, D>(k_s, k_cache, table, kv_begin, kv_end, kv_head, num_kv_heads, blocks);
  cp_async_commit();
  if (threadIdx.x < FLASH_ROWS) {
    const int r = row0 + threadIdx.x;
    const bool valid = r < rows;
    FlashRow row;
    row.q_offset = flash_row_offset(valid, r, group, q_first, kv_head, row_len, D);
    row.out_offset = flash_row_offset(valid, r, group, q_first, kv_head, static_cast<long long>(num_heads) * D, D);
    row.pos = past + r / group;
    row.valid = valid;
    rows_s[threadIdx.x] = row;
  }
  __syncthreads();

  unsigned q_regs[FlashTile<D>::Q_STEPS][4];
  if constexpr (FlashTile<D>::Q_IN_REGS) {
    const FlashRow& row_a = warp_rows[g];
    const FlashRow& row_b = warp_rows[g + 8];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      flash_q_fragment(q_regs[kk], qkv + row_a.q_offset, qkv + row_b.q_offset, row_a.valid, row_b.valid, kk, c);
    }
  }

  float o[D / 8][4];
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
  FlashSoftmax state = {neg_inf(), neg_inf(), 0.0f, 0.0f};
  const float scale_log2 = scale * 1.4426950408889634f;

  for (int k0 = kv_begin; k0 < kv_end; k0 += BK) {
    flash_load_tile<T, D>(v_s, v_cache, table, k0, kv_end, kv_head, num_kv_heads, blocks);
    cp_async_commit();
    cp_async_wait<1>();  // K(j) has landed (V(j) may still be in flight)
    __syncthreads();

    const bool work = warp_active && k0 <= w_last && (window <= 0 || k0 + BK - 1 > w_first - window);
    float s[BK / 8][4];
    if (work) flash_scores<T, D>(s, q_regs, qkv, warp_rows, k_s, lane);
    __syncthreads();  // k_s is free
    if (k0 + BK < kv_end) {
      flash_load_tile<T, D>(k_s, k_cache, table, k0 + BK, kv_end, kv_head, num_kv_heads, blocks);
    }
    cp_async_commit();  // possibly empty: the group count stays the same on every path

    unsigned pa[BK / 16][4];
    if (work) {
      const bool full = k0 + BK - 1 <= w_first && (window <= 0 || k0 > w_last - window);
      flash_softmax<T, D>(pa, s, o, state, scale_log2, k0, c, !full, full ? 0 : warp_rows[g].pos,
                          full ? 0 : warp_rows[g + 8].pos, window);
    }

    cp_async_wait<1>();  // V(j) has landed (K(j+1) may still be in flight)
    __syncthreads();
    if (work) flash_accumulate<T, D>(o, pa, v_s, lane);
    __syncthreads();  // v_s is free
  }
  cp_async_wait<0>();  // the last, empty group

  const float l0 = quad_sum(state.l0);
  const float l1 = quad_sum(state.l1);
  const FlashRow& out_a = warp_rows[g];
  const FlashRow& out_b = warp_rows[g + 8];
  const float inv0 = 1.0f / l0;  // l >= 1 on a valid row: the row's own position is always visible
  const float inv1 = 1.0f / l1;
  T* dst0 = out + out_a.out_offset;
  T* dst1 = out + out_b.out_offset;
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
    const int d = nt * 8 + 2 * c;
    if (out_a.valid) store_pair(dst0 + d, from_float<T>(o[nt][0] * inv0), from_float<T>(o[nt][1] * inv0));
    if (out_b.valid) store_pair(dst1 + d, from_float<T>(o[nt][2] * inv1), from_float<T>(o[nt][3] * inv1));
  }
}
