// shim_tensor_core.h: the host versions of common.cuh's tensor-core wrappers (mma.sync m16n8k16,
// ldmatrix.x4, cp.async), included at the end of cuda_shim.h.
//
// mma and ldmatrix are warp collectives, as on the GPU: each lane hands in its own registers (or row
// address), shim::warp_all_gather gives every lane all 32 lanes' values, and each lane computes its own
// part of the result from the full operands, laid out by the PTX ISA's fragment tables:
//
//   g = lane / 4, c = lane % 4
//   A [16 x 16], element i of a[0..3] (two per register, low half first):
//       row = g for i in {0, 1, 4, 5}, else g + 8;   col = 2c + (i & 1) for i < 4, else 2c + (i & 1) + 8
//   B [16 x 8], element i of b[0..1]:  row = 2c + (i & 1) for i < 2, else 2c + (i & 1) + 8;  col = g
//   C / D [16 x 8], element i of d[0..3]:  row = g for i < 2, else g + 8;  col = 2c + (i & 1)
//   ldmatrix.x4: lane l's address is row l % 8 of matrix l / 8; register i of lane l gets matrix i's
//       [g][2c], [g][2c+1] (.trans: [2c][g], [2c+1][g])
//
// The products are exact in float64 and added to C once, then rounded to float32: the tensor core's own
// accumulation order is unspecified, and every kernel test compares with a tolerance.
//
// cp.async copies are queued per thread and performed when a cp_async_wait completes their group, so
// shared memory read before its wait still holds the launch's poison (0xFF bytes: NaN in f16/bf16/float).
// A thread that finishes its block with copies never waited for aborts (check_block_end).
#pragma once

namespace shim {

inline bool in_dynamic_smem(const void* p, std::size_t bytes) {
  Launch& l = current();
  const unsigned char* b = static_cast<const unsigned char*>(p);
  return b >= l.smem.get() && b + bytes <= l.smem.get() + l.smem_bytes;
}

inline float half_or_bf16(uint16_t bits, bool bf16) {
  return bf16 ? bf16_bits_to_float(bits) : half_bits_to_float(bits);
}

struct MmaOperands {
  unsigned a[4];
  unsigned b[2];
};

inline void mma_m16n8k16(float (&acc)[4], const unsigned (&a)[4], const unsigned (&b)[2], bool bf16) {
  MmaOperands mine;
  std::memcpy(mine.a, a, sizeof mine.a);
  std::memcpy(mine.b, b, sizeof mine.b);
  MmaOperands all[32];
  warp_all_gather(mine, all, "mma.sync");
  double A[16][16];
  double B[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, c = lane & 3;
    for (int i = 0; i < 8; ++i) {
      const int row = (i < 2 || (i >= 4 && i < 6)) ? g : g + 8;
      const int col = 2 * c + (i & 1) + (i >= 4 ? 8 : 0);
      A[row][col] = half_or_bf16(uint16_t(all[lane].a[i / 2] >> (16 * (i & 1))), bf16);
    }
    for (int i = 0; i < 4; ++i) {
      const int row = 2 * c + (i & 1) + (i >= 2 ? 8 : 0);
      B[row][g] = half_or_bf16(uint16_t(all[lane].b[i / 2] >> (16 * (i & 1))), bf16);
    }
  }
  const int lane = lane_id();
  const int g = lane >> 2, c = lane & 3;
  for (int i = 0; i < 4; ++i) {
    const int row = i < 2 ? g : g + 8;
    const int col = 2 * c + (i & 1);
    double sum = 0.0;
    for (int k = 0; k < 16; ++k) sum += A[row][k] * B[k][col];
    acc[i] = float(double(acc[i]) + sum);
  }
}

inline void ldmatrix_x4(unsigned (&r)[4], const void* row, bool trans) {
  if (reinterpret_cast<std::uintptr_t>(row) % 16 != 0) fail("ldmatrix: a row address is not 16-byte aligned");
  if (!in_dynamic_smem(row, 16)) fail("ldmatrix: a row address is not in the block's dynamic shared memory");
  const void* rows[32];
  warp_all_gather(row, rows, "ldmatrix");
  const int lane = lane_id();
  const int g = lane >> 2, c = lane & 3;
  for (int i = 0; i < 4; ++i) {
    uint16_t lo, hi;
    if (trans) {
      std::memcpy(&lo, static_cast<const uint16_t*>(rows[8 * i + 2 * c]) + g, 2);
      std::memcpy(&hi, static_cast<const uint16_t*>(rows[8 * i + 2 * c + 1]) + g, 2);
    } else {
      std::memcpy(&lo, static_cast<const uint16_t*>(rows[8 * i + g]) + 2 * c, 2);
      std::memcpy(&hi, static_cast<const uint16_t*>(rows[8 * i + g]) + 2 * c + 1, 2);
    }
    r[i] = unsigned(lo) | (unsigned(hi) << 16);
  }
}

inline void cp_async_16(void* dst, const void* src, bool valid) {
  if (reinterpret_cast<std::uintptr_t>(dst) % 16 != 0 || reinterpret_cast<std::uintptr_t>(src) % 16 != 0) {
    fail("cp.async: a 16-byte copy between addresses that are not 16-byte aligned");
  }
  if (!in_dynamic_smem(dst, 16)) fail("cp.async: the destination is not in the block's dynamic shared memory");
  tls_open_group.push_back(AsyncCopy{dst, valid ? src : nullptr});
}

inline void cp_async_commit() {
  tls_committed.push_back(std::move(tls_open_group));
  tls_open_group.clear();
}

inline void cp_async_wait(int pending) {
  while (int(tls_committed.size()) > pending) {
    for (const AsyncCopy& copy : tls_committed.front()) {
      if (copy.src != nullptr) std::memcpy(copy.dst, copy.src, 16);
      else std::memset(copy.dst, 0, 16);
    }
    tls_committed.erase(tls_committed.begin());
  }
}

}  // namespace shim
