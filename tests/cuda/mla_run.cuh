// tests/cuda/mla_run.cuh — the definition of MlaDecoder (mla_kernels.hpp), for the .cu files that
// instantiate its run(): a file per group of policies, so that they compile in parallel.
#pragma once

#include <kvattn/cuda/mla_decode.hpp>
#include <kvattn/cuda/plan.hpp>

#include <cstdint>
#include <vector>

#include "device_cache.cuh"
#include "mla_kernels.hpp"

namespace cuda_tests {

struct MlaDecoder::State {
  cudaStream_t stream = nullptr;
  kvattn::cuda::DecodePlan plan;
  kvattn::cuda::PolicyArrays policy_arrays;
  kvattn::cuda::DeviceBuffer<float> q, out, lse;

  // A blocking stream: ordered after the copies and the zero-fill of new device buffers
  // (DeviceMemory::allocate), which run on the default stream.
  State() { kvattn::cuda::check(cudaStreamCreate(&stream), "cudaStreamCreate"); }
  ~State() {
    (void)cudaStreamSynchronize(stream);
    (void)cudaStreamDestroy(stream);
  }
  State(const State&) = delete;
  State& operator=(const State&) = delete;
};

template <class T, class P>
void MlaDecoder::run(const kvattn::PagedKvCache<T>& cache, const std::vector<kvattn::SeqId>& seqs, const kvattn::MlaShape& shape,
                     const std::vector<float>& q, const kvattn::DecodeParams& p, const P& policy, std::vector<float>& out,
                     std::vector<float>* lse, Null null) {
  namespace kc = kvattn::cuda;
  State& s = *state_;
  const cudaStream_t stream = s.stream;
  const std::size_t B = seqs.size(), rows = B * static_cast<std::size_t>(p.queries_per_seq) * static_cast<std::size_t>(shape.heads);
  const std::size_t n_out = rows * static_cast<std::size_t>(shape.latent_dim);

  const DeviceCacheCopy<T> device(cache, seqs);
  const kvattn::BatchPageTable table = device.page_table();
  s.plan.make(device.cache, table, shape, p, stream);
  const P device_policy = s.policy_arrays.upload(policy, s.plan, stream);
  const float* q_dev = s.q.upload(q.data(), q.size(), stream);
  float* out_dev = s.out.reserve(n_out);
  float* lse_dev = lse != nullptr ? s.lse.reserve(rows) : nullptr;
  if (n_out > 0) kc::check(cudaMemsetAsync(out_dev, 0xFF, n_out * sizeof(float), stream), "cudaMemsetAsync (out)");  // NaN
  if (lse_dev != nullptr && rows > 0)
    kc::check(cudaMemsetAsync(lse_dev, 0xFF, rows * sizeof(float), stream), "cudaMemsetAsync (lse)");

  kc::mla_decode(s.plan.view(device.cache, 0), null == Null::q ? nullptr : q_dev, null == Null::out ? nullptr : out_dev, lse_dev,
                 s.plan, stream, device_policy);

  out.assign(n_out, 0.0f);
  if (n_out > 0)
    kc::check(cudaMemcpyAsync(out.data(), out_dev, n_out * sizeof(float), cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync (out)");
  if (lse != nullptr) {
    lse->assign(rows, 0.0f);
    if (rows > 0)
      kc::check(cudaMemcpyAsync(lse->data(), lse_dev, rows * sizeof(float), cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync (lse)");
  }
  // (also before the device cache copy goes: the kernels read it)
  kc::check(cudaStreamSynchronize(stream), "cudaStreamSynchronize (results)");
}

}  // namespace cuda_tests

/// Instantiates MlaDecoder::run<T, P>.
#define CUDA_TESTS_INSTANTIATE_MLA_RUN(T, P)                                                                                       \
  template void cuda_tests::MlaDecoder::run<T, P>(const kvattn::PagedKvCache<T>&, const std::vector<kvattn::SeqId>&,               \
                                                  const kvattn::MlaShape&, const std::vector<float>&, const kvattn::DecodeParams&, \
                                                  const P&, std::vector<float>&, std::vector<float>*, Null);
