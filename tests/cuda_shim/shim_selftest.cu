// shim_selftest.cu: kernels that pin down the execution shim itself (tests/test_cuda_shim.py), so a
// kernel test that passes under the shim means what it would mean on a GPU.
//
//   convert_kernel     f32 -> f16 / bf16 -> f32 round trips, compared with NumPy / ml_dtypes bit by bit
//   shuffle_kernel     __shfl_xor/down/up/_sync with and without width, compared with CUDA's rules
//   atomics_kernel     atomicAdd (float, int, unsigned long long) and atomicMax from every thread
//   smem_kernel        dynamic + static shared memory across a barrier, __syncwarp between lanes
//   divergent_kernel   __syncthreads reached by only half the block: the shim must abort
//   early_return_kernel one thread returns while the others wait at __syncthreads: must abort too
#include "common.cuh"

__global__ void convert_kernel(f16* h, bf16* b, float* h_back, float* b_back, const float* x, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    h[i] = from_float<f16>(x[i]);
    b[i] = from_float<bf16>(x[i]);
    h_back[i] = to_float(h[i]);
    b_back[i] = to_float(b[i]);
  }
}

__global__ void shuffle_kernel(int* out) {
  const int tid = threadIdx.x;
  const int v = 3 * tid + 1;
  int* o = out + 6 * (blockIdx.x * blockDim.x + tid);
  o[0] = __shfl_xor_sync(RAWINFER_FULL_MASK, v, 5);
  o[1] = __shfl_down_sync(RAWINFER_FULL_MASK, v, 3);
  o[2] = __shfl_up_sync(RAWINFER_FULL_MASK, v, 2);
  o[3] = __shfl_sync(RAWINFER_FULL_MASK, v, 7);
  o[4] = __shfl_xor_sync(RAWINFER_FULL_MASK, v, 9, 8);
  o[5] = __shfl_down_sync(RAWINFER_FULL_MASK, v, 3, 8);
}

__global__ void atomics_kernel(float* fsum, int* isum, int* imax, unsigned long long* usum) {
  atomicAdd(fsum, 1.0f);
  atomicAdd(isum, static_cast<int>(threadIdx.x));
  atomicMax(imax, static_cast<int>(blockIdx.x * 1000 + threadIdx.x));
  atomicAdd(usum, 1ull << 33);
}

__global__ void smem_kernel(float* out, int* warp_out) {
  DYNAMIC_SHARED(float, dyn);
  __shared__ int lanes[1024];
  const int n = blockDim.x;
  const int tid = threadIdx.x;
  dyn[tid] = static_cast<float>(tid * (blockIdx.x + 1));
  lanes[tid] = tid * 10 + static_cast<int>(blockIdx.x);
  __syncwarp();
  const int lane = tid % 32;
  const int neighbour = tid - lane + (lane + 1) % 32;
  warp_out[blockIdx.x * n + tid] = lanes[neighbour];
  __syncthreads();
  out[blockIdx.x * n + tid] = dyn[n - 1 - tid];
}

__global__ void divergent_kernel(int* out) {
  if (threadIdx.x < 16) __syncthreads();
  out[threadIdx.x] = 1;
}

__global__ void early_return_kernel(int* out) {
  if (threadIdx.x == 0) return;
  __syncthreads();
  out[threadIdx.x] = 1;
}
