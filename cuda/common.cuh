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
