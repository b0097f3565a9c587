// common.cuh: the element types, conversions and block/warp reductions shared by every kernel file.
//
// Every .cu file of rawinfer is compiled three ways, from the same text:
//   - by NVRTC at run time (CuPy RawModule, rawinfer/backend/cuda/runtime.py);
//   - by nvcc for sm_80 and sm_90 in CI (tools/check_cuda.sh: warnings are errors, spills fail);
//   - by g++ on the host under the execution shim tests/cuda_shim/cuda_shim.h (-DRAWINFER_SHIM).
// So this header includes nothing (NVRTC has no standard headers and CuPy wheels may lack cuda_fp16.h):
// fp16 and bf16 are two-byte structs converted with one PTX instruction on the GPU and with the shim's
// bit-exact software conversions on the host.
//
// Element types (template parameter T of the kernels) and their NumPy counterparts:
//     float  <-> float32
//     f16    <-> float16
//     bf16   <-> bfloat16 (ml_dtypes on the host; uint16 bit patterns in CuPy, which has no bfloat16)
// All arithmetic is in float32; T is only how values are stored.
//
// Reductions assume blockDim.x is a multiple of 32 and at most 1024, and that every thread of the
// block calls them (they contain __syncthreads).  Shuffles always use the full warp mask.
#pragma once

#ifdef RAWINFER_SHIM
#define RAWINFER_DEVICE inline
#else
#define RAWINFER_DEVICE __device__ __forceinline__
#endif

struct __align__(2) f16 { unsigned short bits; };
struct __align__(2) bf16 { unsigned short bits; };
// A float8 e4m3fn weight (rawinfer/quant.py's "fp8"): sign, 4 exponent bits (bias 7), 3 mantissa bits; no
// infinities, S.1111.111 is NaN, the largest finite value 448.  Stored as uint8 (or ml_dtypes' float8_e4m3fn).
struct __align__(1) e4m3 { unsigned char bits; };

#define RAWINFER_FULL_MASK 0xFFFFFFFFu

// DYNAMIC_SHARED(float, smem) declares `float* smem`, the block's dynamic shared memory (the byte count
// is a launch parameter).  16-byte aligned, so any element type may be carved from it.
#ifdef RAWINFER_SHIM
#define DYNAMIC_SHARED(type, name) type* name = reinterpret_cast<type*>(shim::dynamic_smem())
#else
#define DYNAMIC_SHARED(type, name)                                  \
  extern __shared__ __align__(16) unsigned char dynamic_smem_bytes[]; \
  type* name = reinterpret_cast<type*>(dynamic_smem_bytes)
#endif

// +infinity as a float, without <cmath>/<float.h> (neither exists under NVRTC).
RAWINFER_DEVICE float pos_inf() { return __int_as_float(0x7F800000); }
RAWINFER_DEVICE float neg_inf() { return __int_as_float(static_cast<int>(0xFF800000u)); }

RAWINFER_DEVICE int imin(int a, int b) { return a < b ? a : b; }
RAWINFER_DEVICE int imax(int a, int b) { return a > b ? a : b; }
RAWINFER_DEVICE int ceil_div(int a, int b) { return (a + b - 1) / b; }

// ---- conversions -----------------------------------------------------------------------------------
RAWINFER_DEVICE float to_float(float x) { return x; }

// A weight-only format's stored value as float32 (weight_only_linear.cu): exact for both.  e4m3: normal values
// move their exponent (rebiased 7 -> 127) and mantissa into float32's fields; subnormals are the mantissa
// times 2^-9.  (Own name, not a to_float overload: an integer argument would make to_float ambiguous.)
RAWINFER_DEVICE float weight_value(e4m3 x) {
  const unsigned mag = x.bits & 0x7Fu;
  float v = static_cast<float>(mag) * 0.001953125f;
  if (mag >= 0x08u) v = __uint_as_float((((mag >> 3) + 120u) << 23) | ((mag & 7u) << 20));
  if (mag == 0x7Fu) v = __uint_as_float(0x7FC00000u);
  return (x.bits & 0x80u) ? -v : v;
}

RAWINFER_DEVICE float weight_value(signed char x) { return static_cast<float>(x); }

RAWINFER_DEVICE float to_float(f16 x) {
#ifdef RAWINFER_SHIM
  return shim::half_bits_to_float(x.bits);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
#endif
}

RAWINFER_DEVICE float to_float(bf16 x) {
  return __uint_as_float(static_cast<unsigned>(x.bits) << 16);
}

template <typename T>
RAWINFER_DEVICE T from_float(float x);

template <>
RAWINFER_DEVICE float from_float<float>(float x) { return x; }

template <>
RAWINFER_DEVICE f16 from_float<f16>(float x) {
  f16 h;
#ifdef RAWINFER_SHIM
  h.bits = shim::float_to_half_bits(x);
#else
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
#endif
  return h;
}

template <>
RAWINFER_DEVICE bf16 from_float<bf16>(float x) {
  bf16 b;
#ifdef RAWINFER_SHIM
  b.bits = shim::float_to_bf16_bits(x);
#else
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b.bits) : "f"(x));  // sm_80 and newer
#endif
  return b;
}

// ---- 16-byte vectors ---------------------------------------------------------------------------------
// One aligned 16-byte load moves VecOf<T>::N elements: the widest access a thread can issue, used by the
// attention kernels to stream K/V rows.  Callers guarantee 16-byte alignment (rows of D elements with
// D * sizeof(T) a multiple of 16, buffers from the pool's 256-byte-aligned carve).
template <typename T>
struct __align__(16) VecOf {
  static constexpr int N = 16 / static_cast<int>(sizeof(T));
  T v[N];
};

template <typename T>
RAWINFER_DEVICE VecOf<T> load_vec(const T* p) { return *reinterpret_cast<const VecOf<T>*>(p); }

// ---- reductions --------------------------------------------------------------------------------------
RAWINFER_DEVICE float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(RAWINFER_FULL_MASK, v, offset);
  return v;
}

RAWINFER_DEVICE float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(RAWINFER_FULL_MASK, v, offset));
  return v;
}

// Sum over the whole block, returned to every thread.  scratch: 32 floats of shared memory, reused
// after the call returns (the trailing barrier makes that safe).
RAWINFER_DEVICE float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int nwarps = blockDim.x / 32;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < nwarps ? scratch[lane] : 0.0f;
  v = warp_sum(v);
  __syncthreads();
  return v;
}

RAWINFER_DEVICE float block_max(float v, float* scratch) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int nwarps = blockDim.x / 32;
  v = warp_max(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < nwarps ? scratch[lane] : neg_inf();
  v = warp_max(v);
  __syncthreads();
  return v;
}

// Integer count over the whole block (exact, so results never depend on summation order).
RAWINFER_DEVICE int block_count(int v, int* scratch) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int nwarps = blockDim.x / 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(RAWINFER_FULL_MASK, v, offset);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < nwarps ? scratch[lane] : 0;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(RAWINFER_FULL_MASK, v, offset);
  __syncthreads();
  return v;
}

// (value, index) pairs: the larger value wins, and on equal values the smaller index (NumPy's argmax).
struct ArgMax {
  float value;
  int index;
};

RAWINFER_DEVICE ArgMax argmax_pick(ArgMax a, ArgMax b) {
  if (b.value > a.value || (b.value == a.value && b.index < a.index)) return b;
  return a;
}

RAWINFER_DEVICE ArgMax warp_argmax(ArgMax a) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    ArgMax other;
    other.value = __shfl_xor_sync(RAWINFER_FULL_MASK, a.value, offset);
    other.index = __shfl_xor_sync(RAWINFER_FULL_MASK, a.index, offset);
    a = argmax_pick(a, other);
  }
  return a;
}

// Block-wide argmax returned to every thread.  value_scratch / index_scratch: 32 entries each.
RAWINFER_DEVICE ArgMax block_argmax(ArgMax a, float* value_scratch, int* index_scratch) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int nwarps = blockDim.x / 32;
  a = warp_argmax(a);
  if (lane == 0) {
    value_scratch[warp] = a.value;
    index_scratch[warp] = a.index;
  }
  __syncthreads();
  if (lane < nwarps) {
    a.value = value_scratch[lane];
    a.index = index_scratch[lane];
  } else {
    a.value = neg_inf();
    a.index = 0x7FFFFFFF;
  }
  a = warp_argmax(a);
  __syncthreads();
  return a;
}

// ---- tensor cores: mma.sync, ldmatrix, cp.async ---------------------------------------------------
// Thin wrappers over the sm_80 warp-level matrix instructions, so that a kernel reads like the PTX ISA's
// tables and the host shim can run it: on the host each wrapper is a warp collective of
// tests/cuda_shim/cuda_shim.h that gathers all 32 lanes' registers in PTX's documented fragment layout,
// computes the result and hands each lane its part (tests/backend/test_cuda_shim_mma.py pins the layouts).
// Every lane of the warp must call them together (as on the GPU: .sync.aligned).
//
// A "fragment register" is 32 bits holding two 16-bit elements, the lower column (or row) index in the
// low half.  With g = lane / 4 and c = lane % 4 (PTX: groupID, threadID_in_group), m16n8k16 holds
//
//   A [16 x 16] row-major, a[4]:  a[0] = A[g][2c, 2c+1]      a[1] = A[g+8][2c, 2c+1]
//                                 a[2] = A[g][2c+8, 2c+9]    a[3] = A[g+8][2c+8, 2c+9]
//   B [16 x 8] (k x n), b[2]:     b[0] = B[2c, 2c+1][g]      b[1] = B[2c+8, 2c+9][g]
//   C, D [16 x 8] float, d[4]:    d[0], d[1] = D[g][2c, 2c+1]   d[2], d[3] = D[g+8][2c, 2c+1]
//
// ldmatrix.x4 loads four 8 x 8 matrices of 16-bit elements from shared memory: lane l hands in the
// address of row l % 8 of matrix l / 8 (16 contiguous bytes, 16-byte aligned), and register i of lane
// l receives matrix i's row g, columns 2c and 2c+1 (.trans: column g, rows 2c and 2c+1).  So a row-major
// tile read with ldmatrix is an A fragment (or, for a tile stored [n][k], a B fragment), and .trans
// turns a [k][n] tile into B fragments.
template <typename T>
RAWINFER_DEVICE unsigned pack2(T lo, T hi) {
  return static_cast<unsigned>(lo.bits) | (static_cast<unsigned>(hi.bits) << 16);
}

// Two consecutive 16-bit elements as one fragment register, and back: one 32-bit access (p 4-byte aligned,
// which the shim checks).
template <typename T>
RAWINFER_DEVICE unsigned load_pair(const T* p) {
#ifdef RAWINFER_SHIM
  if (reinterpret_cast<unsigned long long>(p) % 4 != 0) shim::fail("load_pair: address not 4-byte aligned");
  return pack2(p[0], p[1]);
#else
  return *reinterpret_cast<const unsigned*>(p);
#endif
}

template <typename T>
RAWINFER_DEVICE void store_pair(T* p, T lo, T hi) {
#ifdef RAWINFER_SHIM
  if (reinterpret_cast<unsigned long long>(p) % 4 != 0) shim::fail("store_pair: address not 4-byte aligned");
  p[0] = lo;
  p[1] = hi;
#else
  *reinterpret_cast<unsigned*>(p) = pack2(lo, hi);
#endif
}

// The 32-bit shared-memory address of a generic pointer into shared memory (what ldmatrix and cp.async take).
#ifndef RAWINFER_SHIM
RAWINFER_DEVICE unsigned smem_address(const void* p) {
  unsigned a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
#endif

// acc += A B for one m16n8k16 tile (f16 or bf16 inputs, float32 accumulation).
template <typename T>
RAWINFER_DEVICE void mma_m16n8k16(float (&acc)[4], const unsigned (&a)[4], const unsigned (&b)[2]);

template <>
RAWINFER_DEVICE void mma_m16n8k16<bf16>(float (&acc)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
#ifdef RAWINFER_SHIM
  shim::mma_m16n8k16(acc, a, b, true);
#else
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};"
               : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

template <>
RAWINFER_DEVICE void mma_m16n8k16<f16>(float (&acc)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
#ifdef RAWINFER_SHIM
  shim::mma_m16n8k16(acc, a, b, false);
#else
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};"
               : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// Four 8 x 8 tiles of 16-bit elements from shared memory (row: this lane's row address, see above).
RAWINFER_DEVICE void ldmatrix_x4(unsigned (&r)[4], const void* row) {
#ifdef RAWINFER_SHIM
  shim::ldmatrix_x4(r, row, false);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_address(row)));
#endif
}

RAWINFER_DEVICE void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) {
#ifdef RAWINFER_SHIM
  shim::ldmatrix_x4(r, row, true);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_address(row)));
#endif
}

// cp.async: 16 bytes global -> shared without passing through registers, completed by a later
// cp_async_wait<N>() (all but the N most recently committed groups are complete, and visible to this
// thread; a __syncthreads makes them visible to the block).  valid = false writes 16 zero bytes and reads
// nothing (src must still be a valid address): rows past a sequence's end are never fetched.
// The shim performs each group's copies at the wait that completes it, so a kernel that reads shared
// memory before its wait sees the shim's poison there, never the data.
RAWINFER_DEVICE void cp_async_16(void* dst, const void* src, bool valid) {
#ifdef RAWINFER_SHIM
  shim::cp_async_16(dst, src, valid);
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
               :: "r"(smem_address(dst)), "l"(src), "r"(valid ? 16 : 0) : "memory");
#endif
}

RAWINFER_DEVICE void cp_async_commit() {
#ifdef RAWINFER_SHIM
  shim::cp_async_commit();
#else
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

template <int N>
RAWINFER_DEVICE void cp_async_wait() {
#ifdef RAWINFER_SHIM
  shim::cp_async_wait(N);
#else
  asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
#endif
}
