// cuda_shim.h: runs CUDA C kernels on the host, one real std::thread per CUDA thread.
//
// Included before a kernel file (with -DRAWINFER_SHIM) by tests/cuda_shim/harness.py, which compiles the
// pair with g++ -std=c++20 -pthread into a shared library.  The model is the CUDA execution model with
// nothing left out that our kernels rely on:
//
//   launch(grid, block, smem, body)   one std::thread per thread of a block; every thread walks the
//                                     blocks of the grid in order (x fastest), so blocks run one after
//                                     another and all threads of one block run concurrently
//   threadIdx / blockIdx              thread_local;  blockDim / gridDim: set per launch
//   __syncthreads()                   a block-wide barrier; the end of each block is a barrier too
//   __shared__                        `static`: function-static storage is shared by all host threads,
//                                     exactly like shared memory is by the threads of one block
//   dynamic shared memory             one buffer per launch (poisoned with 0xFF bytes, so a kernel that
//                                     reads shared memory it never wrote sees NaNs), see shim::dynamic_smem
//   __shfl_*_sync, __syncwarp         through a per-warp exchange: each lane writes its value into the
//                                     warp's slot array, a warp barrier, each lane reads its source slot,
//                                     a second warp barrier (so no slot is overwritten before it is read)
//   atomics                           std::atomic_ref
//   fp16 / bf16                       bit-exact round-to-nearest-even conversions (shim::float_to_*)
//   mma.sync, ldmatrix, cp.async      warp collectives and deferred copies, see shim_tensor_core.h
//
// Misuse that would be a bug on the GPU is a hard error here, never a silent success:
//   - threads of one block meeting different barriers (a __syncthreads inside divergent code, or some
//     threads returning early while others wait) abort with a message naming the two barrier kinds;
//   - a shuffle whose mask is not the whole warp, or whose source lane does not exist, aborts;
//   - a launch in which no thread makes progress for RAWINFER_SHIM_DEADLOCK_S seconds (default 60)
//     aborts instead of hanging the test run.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <thread>
#include <type_traits>
#include <vector>

// ---- CUDA keywords ---------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) alignas(n)

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

inline thread_local dim3 threadIdx;
inline thread_local dim3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;
constexpr int warpSize = 32;

namespace shim {

[[noreturn]] inline void fail(const char* fmt, ...) {
  std::va_list ap;
  va_start(ap, fmt);
  std::fputs("cuda_shim: ", stderr);
  std::vfprintf(stderr, fmt, ap);
  std::fputc('\n', stderr);
  va_end(ap);
  std::fflush(stderr);
  std::abort();
}

enum class Sync : int { kNone = 0, kSyncThreads = 1, kBlockEnd = 2, kShuffle = 3, kSyncWarp = 4, kMatrix = 5 };

inline const char* sync_name(int kind) {
  switch (kind) {
    case 1: return "__syncthreads()";
    case 2: return "the end of the block (a thread returned)";
    case 3: return "a warp shuffle";
    case 4: return "__syncwarp()";
    case 5: return "a warp-collective matrix instruction (mma / ldmatrix)";
    default: return "?";
  }
}

// A reusable barrier for n threads that also checks that every thread arrived at the same kind of
// synchronisation point.  Waiting uses std::atomic::wait (a futex on Linux), so a waiting thread
// sleeps instead of spinning: the machines running CI have far fewer cores than a block has threads.
class Barrier {
 public:
  void reset(int n) { n_ = n; }

  void arrive_and_wait(Sync kind, std::atomic<unsigned long>& progress) {
    const unsigned gen = gen_.load(std::memory_order_acquire);
    int expected = 0;
    if (!kind_.compare_exchange_strong(expected, int(kind), std::memory_order_acq_rel) &&
        expected != int(kind)) {
      fail("divergent synchronisation: one thread is at %s while another is at %s; every thread of "
           "the block (or warp) must reach the same barriers", sync_name(int(kind)), sync_name(expected));
    }
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_) {
      arrived_.store(0, std::memory_order_relaxed);
      kind_.store(0, std::memory_order_relaxed);
      progress.fetch_add(1, std::memory_order_relaxed);
      gen_.fetch_add(1, std::memory_order_acq_rel);
      gen_.notify_all();
    } else {
      unsigned now = gen_.load(std::memory_order_acquire);
      while (now == gen) {
        gen_.wait(now, std::memory_order_acquire);
        now = gen_.load(std::memory_order_acquire);
      }
    }
  }

 private:
  int n_ = 0;
  std::atomic<int> arrived_{0};
  std::atomic<int> kind_{0};
  std::atomic<unsigned> gen_{0};
};

struct Warp {
  int size = 0;                 // threads in this warp (the last warp of a block may be partial)
  unsigned full_mask = 0;       // one bit per existing lane
  Barrier bar;
  unsigned long long slots[32] = {};
  alignas(16) unsigned char gather[32][48] = {};  // one lane's operands of a matrix instruction
};

struct Launch {
  dim3 grid, block;
  int nthreads = 0;
  std::size_t smem_bytes = 0;
  std::unique_ptr<unsigned char[]> smem;
  Barrier block_bar;
  std::unique_ptr<Warp[]> warps;
  std::atomic<unsigned long> progress{0};
  std::atomic<int> finished{0};
};

inline thread_local Launch* tls_launch = nullptr;
inline thread_local int tls_tid = 0;  // linear thread index within the block

inline Launch& current() {
  if (tls_launch == nullptr) fail("a CUDA built-in was used outside a kernel launch");
  return *tls_launch;
}

// The dynamic shared memory of the running launch (extern __shared__ on the GPU).
inline unsigned char* dynamic_smem() { return current().smem.get(); }

inline void syncthreads() { Launch& l = current(); l.block_bar.arrive_and_wait(Sync::kSyncThreads, l.progress); }

inline Warp& my_warp(unsigned mask, const char* what) {
  Launch& l = current();
  Warp& w = l.warps[tls_tid / 32];
  if (mask != w.full_mask) {
    fail("%s with mask 0x%08x but the warp's lanes are 0x%08x: the shim supports only whole-warp "
         "shuffles and __syncwarp (which is also what our kernels promise)", what, mask, w.full_mask);
  }
  return w;
}

template <class T>
T exchange(unsigned mask, T value, int src_lane, const char* what) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffle of an unsupported type");
  Launch& l = current();
  Warp& w = my_warp(mask, what);
  const int lane = tls_tid % 32;
  if (src_lane < 0 || src_lane >= w.size) fail("%s reads lane %d of a warp of %d threads", what, src_lane, w.size);
  std::memcpy(&w.slots[lane], &value, sizeof(T));
  w.bar.arrive_and_wait(Sync::kShuffle, l.progress);
  T out;
  std::memcpy(&out, &w.slots[src_lane], sizeof(T));
  w.bar.arrive_and_wait(Sync::kShuffle, l.progress);
  return out;
}

inline int lane_id() { return tls_tid % 32; }

// Every lane of a whole warp hands in `mine`; each gets all 32 lanes' values (lane order) in `all`.
template <class P>
void warp_all_gather(const P& mine, P* all, const char* what) {
  static_assert(sizeof(P) <= 48 && std::is_trivially_copyable_v<P>, "warp gather of an unsupported type");
  Launch& l = current();
  Warp& w = l.warps[tls_tid / 32];
  if (w.size != 32) fail("%s in a warp of %d threads: matrix instructions need the whole warp", what, w.size);
  std::memcpy(w.gather[tls_tid % 32], &mine, sizeof(P));
  w.bar.arrive_and_wait(Sync::kMatrix, l.progress);
  for (int lane = 0; lane < 32; ++lane) std::memcpy(&all[lane], w.gather[lane], sizeof(P));
  w.bar.arrive_and_wait(Sync::kMatrix, l.progress);
}

// cp.async copies of this thread: the open group, then the committed ones, oldest first.
struct AsyncCopy {
  void* dst;
  const void* src;  // nullptr: zero-fill
};
inline thread_local std::vector<AsyncCopy> tls_open_group;
inline thread_local std::vector<std::vector<AsyncCopy>> tls_committed;

inline void check_block_end() {
  if (!tls_open_group.empty() || !tls_committed.empty()) {
    fail("a thread ended its block with cp.async copies never waited for (cp_async_wait<0>() missing)");
  }
}

// ---- fp16 / bf16 bit conversions (round to nearest even, like cvt.rn on the GPU) --------------------
inline float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  if (exp == 0x1F) return bits_to_float(sign | 0x7F800000u | (man << 13));     // inf / nan
  if (exp != 0) return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));  // normal
  // zero or subnormal: man * 2^-24, exact in float
  const float v = std::ldexp(float(man), -24);
  return sign ? -v : v;
}

inline uint16_t float_to_half_bits(float f) {
  const uint32_t u = float_to_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return uint16_t(sign | 0x7E00u);           // nan
  if (abs >= 0x477FF000u) return uint16_t(sign | 0x7C00u);          // rounds to >= 65520: inf
  if (abs < 0x38800000u) {                                           // below 2^-14: subnormal or zero
    // value = abs_float; quantum 2^-24: round(value * 2^24) with ties to even (nearbyint, FE_TONEAREST)
    const float v = bits_to_float(abs);
    const float q = std::nearbyint(std::ldexp(v, 24));
    return uint16_t(sign | uint16_t(q));                              // q == 1024 gives the smallest normal
  }
  // normal: drop 13 mantissa bits with round-to-nearest-even; a carry into the exponent is correct
  uint32_t m = abs - (112u << 23);
  const uint32_t lsb = (m >> 13) & 1u;
  m += 0x0FFFu + lsb;
  return uint16_t(sign | uint16_t(m >> 13));
}

inline float bf16_bits_to_float(uint16_t b) { return bits_to_float(uint32_t(b) << 16); }

inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t(((u >> 16) & 0x8000u) | 0x7FC0u);  // nan
  const uint32_t lsb = (u >> 16) & 1u;
  u += 0x7FFFu + lsb;
  return uint16_t(u >> 16);
}

// ---- launching ---------------------------------------------------------------------------------------
inline double deadlock_seconds() {
  const char* s = std::getenv("RAWINFER_SHIM_DEADLOCK_S");
  return s ? std::atof(s) : 60.0;
}

template <class Body>
void launch(dim3 grid, dim3 block, std::size_t smem_bytes, Body&& body) {
  const long nthreads = long(block.x) * block.y * block.z;
  if (nthreads < 1 || nthreads > 1024) fail("a block of %ld threads (CUDA allows 1 to 1024)", nthreads);
  if (grid.x < 1 || grid.y < 1 || grid.z < 1 || grid.y > 65535 || grid.z > 65535) {
    fail("grid (%u, %u, %u) is outside CUDA's limits", grid.x, grid.y, grid.z);
  }
  if (tls_launch != nullptr) fail("a kernel launched from inside a kernel");

  Launch l;
  l.grid = grid;
  l.block = block;
  l.nthreads = int(nthreads);
  l.smem_bytes = smem_bytes;
  l.smem.reset(new (std::align_val_t(64)) unsigned char[std::max<std::size_t>(smem_bytes, 16)]);
  std::memset(l.smem.get(), 0xFF, std::max<std::size_t>(smem_bytes, 16));
  l.block_bar.reset(l.nthreads);
  const int nwarps = (l.nthreads + 31) / 32;
  l.warps.reset(new Warp[nwarps]);
  for (int w = 0; w < nwarps; ++w) {
    l.warps[w].size = std::min(32, l.nthreads - 32 * w);
    l.warps[w].full_mask = l.warps[w].size == 32 ? 0xFFFFFFFFu : ((1u << l.warps[w].size) - 1u);
    l.warps[w].bar.reset(l.warps[w].size);
  }
  blockDim = block;
  gridDim = grid;

  std::vector<std::thread> threads;
  threads.reserve(l.nthreads);
  for (int tid = 0; tid < l.nthreads; ++tid) {
    threads.emplace_back([&l, &body, tid] {
      tls_launch = &l;
      tls_tid = tid;
      threadIdx = dim3(tid % l.block.x, (tid / l.block.x) % l.block.y, tid / (l.block.x * l.block.y));
      for (unsigned z = 0; z < l.grid.z; ++z)
        for (unsigned y = 0; y < l.grid.y; ++y)
          for (unsigned x = 0; x < l.grid.x; ++x) {
            blockIdx = dim3(x, y, z);
            body();
            check_block_end();
            l.block_bar.arrive_and_wait(Sync::kBlockEnd, l.progress);
          }
      tls_launch = nullptr;
      l.finished.fetch_add(1, std::memory_order_release);
    });
  }
  // Watchdog: the launching thread only watches for lack of progress.
  const double limit = deadlock_seconds();
  unsigned long last = ~0ul;
  auto last_change = std::chrono::steady_clock::now();
  while (l.finished.load(std::memory_order_acquire) < l.nthreads) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    const unsigned long p = l.progress.load(std::memory_order_relaxed);
    const auto now = std::chrono::steady_clock::now();
    if (p != last) {
      last = p;
      last_change = now;
    } else if (std::chrono::duration<double>(now - last_change).count() > limit) {
      fail("deadlock: no barrier completed for %.0f s (a thread waits at a barrier the others never "
           "reach, e.g. __syncthreads or a shuffle inside divergent code)", limit);
    }
  }
  for (auto& t : threads) t.join();
}

}  // namespace shim

// ---- CUDA device built-ins -------------------------------------------------------------------------
inline void __syncthreads() { shim::syncthreads(); }

inline void __syncwarp(unsigned mask = 0xFFFFFFFFu) {
  shim::Launch& l = shim::current();
  shim::my_warp(mask, "__syncwarp").bar.arrive_and_wait(shim::Sync::kSyncWarp, l.progress);
}

template <class T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  const int lane = shim::lane_id();
  return shim::exchange(mask, var, (lane & ~(width - 1)) + (src_lane & (width - 1)), "__shfl_sync");
}

template <class T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  const int lane = shim::lane_id();
  int src = lane ^ lane_mask;
  if (src >= (lane & ~(width - 1)) + width) src = lane;
  return shim::exchange(mask, var, src, "__shfl_xor_sync");
}

template <class T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  const int lane = shim::lane_id();
  const int src = (lane & (width - 1)) + int(delta) < width ? lane + int(delta) : lane;
  return shim::exchange(mask, var, src, "__shfl_down_sync");
}

template <class T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  const int lane = shim::lane_id();
  const int src = (lane & (width - 1)) >= int(delta) ? lane - int(delta) : lane;
  return shim::exchange(mask, var, src, "__shfl_up_sync");
}

inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }

template <class T>
T atomicAdd(T* address, T val) { return std::atomic_ref<T>(*address).fetch_add(val); }
template <class T>
T atomicSub(T* address, T val) { return std::atomic_ref<T>(*address).fetch_sub(val); }
template <class T>
T atomicExch(T* address, T val) { return std::atomic_ref<T>(*address).exchange(val); }
template <class T>
T atomicCAS(T* address, T compare, T val) {
  std::atomic_ref<T>(*address).compare_exchange_strong(compare, val);
  return compare;  // the old value in both cases
}
template <class T>
T atomicMax(T* address, T val) {
  std::atomic_ref<T> a(*address);
  T old = a.load();
  while (old < val && !a.compare_exchange_weak(old, val)) {}
  return old;
}
template <class T>
T atomicMin(T* address, T val) {
  std::atomic_ref<T> a(*address);
  T old = a.load();
  while (val < old && !a.compare_exchange_weak(old, val)) {}
  return old;
}

inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __fdividef(float a, float b) { return a / b; }

#include "shim_tensor_core.h"
