// rmsnorm.cu: RMSNorm, and RMSNorm fused with the residual add that precedes it in every layer.
//
//   rmsnorm_kernel:           out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight
//   add_rmsnorm_kernel:       residual[t] += x[t];  out[t] = rmsnorm(residual[t]) * weight   (in place)
//   norm_add_rmsnorm_kernel:  residual[t] += rmsnorm(x[t]) * x_weight;  out[t] = rmsnorm(residual[t]) * weight
//                             (sandwich norms, Gemma 3: the attention or MLP output is normalised before its
//                             residual add; one pass instead of rmsnorm_kernel writing x and add_rmsnorm
//                             reading it back)
//
// Layouts (row-major, C-contiguous):
//   rmsnorm:      x [T, C] R,  weight [C] T,  out [T, C] T
//   add_rmsnorm:  x [T, C] T,  residual [T, C] R,  weight [C] T,  out [T, C] T
//   norm_add_rmsnorm: as add_rmsnorm, plus x_weight [C] T; x is only read
// R is the residual stream's type: float32 (what the engine's pool uses), or T itself.
// Statistics are float32.  NOTE: add_rmsnorm stores the new residual in R first and takes statistics
// of the stored value, so the output equals rmsnorm() of the stored residual, exactly as two separate
// kernels would give; norm_add_rmsnorm likewise rounds rmsnorm(x) * x_weight to T before the add, so it
// equals rmsnorm_kernel (in place on x) then add_rmsnorm_kernel bit for bit.  out may be the same buffer
// as x when their types agree (each thread reads and writes only its own columns).
// Launch: grid (T), block (threads, 1, 1) with threads a multiple of 32 (at most 1024); 32 floats of
// static shared memory for the block reduction.
#include "common.cuh"

template <typename T, typename R>
__global__ void __launch_bounds__(1024) rmsnorm_kernel(T* out, const R* x, const T* __restrict__ weight,
                                                       int hidden, float eps) {
  __shared__ float scratch[32];
  const long long base = static_cast<long long>(blockIdx.x) * hidden;
  float sum_sq = 0.0f;
  for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
    const float v = to_float(x[base + c]);
    sum_sq += v * v;
  }
  sum_sq = block_sum(sum_sq, scratch);
  const float inv_rms = rsqrtf(sum_sq / static_cast<float>(hidden) + eps);
  for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
    out[base + c] = from_float<T>(to_float(x[base + c]) * inv_rms * to_float(weight[c]));
  }
}

template <typename T, typename R>
__global__ void __launch_bounds__(1024) add_rmsnorm_kernel(T* out, R* residual, const T* x,
                                                           const T* __restrict__ weight, int hidden,
                                                           float eps) {
  __shared__ float scratch[32];
  const long long base = static_cast<long long>(blockIdx.x) * hidden;
  float sum_sq = 0.0f;
  for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
    const R r = from_float<R>(to_float(residual[base + c]) + to_float(x[base + c]));
    residual[base + c] = r;
    const float v = to_float(r);
    sum_sq += v * v;
  }
  sum_sq = block_sum(sum_sq, scratch);
  const float inv_rms = rsqrtf(sum_sq / static_cast<float>(hidden) + eps);
  for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
    out[base + c] = from_float<T>(to_float(residual[base + c]) * inv_rms * to_float(weight[c]));
  }
}

template <typename T, typename R>
__global__ void __launch_bounds__(1024) norm_add_rmsnorm_kernel(T* out, R* residual, const T* x,
                                                                const T* __restrict__ x_weight,
                                                                const T* __restrict__ weight, int hidden,
                                                                float eps) {
  __shared__ float scratch[32];
  const long long base = static_cast<long long>(blockIdx.x) * hidden;
  float x_sum_sq = 0.0f;
  for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
    const float v = to_float(x[base + c]);
    x_sum_sq += v * v;
  }
  x_sum_sq = block_sum(x_sum_sq, scratch);
  const float x_inv_rms = rsqrtf(x_sum_sq / static_cast<float>(hidden) + eps);
  float sum_sq = 0.0f;
  for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
    const T normed = from_float<T>(to_float(x[base + c]) * x_inv_rms * to_float(x_weight[c]));
    const R r = from_float<R>(to_float(residual[base + c]) + to_float(normed));
    residual[base + c] = r;
    const float v = to_float(r);
    sum_sq += v * v;
  }
  sum_sq = block_sum(sum_sq, scratch);
  const float inv_rms = rsqrtf(sum_sq / static_cast<float>(hidden) + eps);
  for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
    out[base + c] = from_float<T>(to_float(residual[base + c]) * inv_rms * to_float(weight[c]));
  }
}
