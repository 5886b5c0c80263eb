// tests/cuda/gqa_run.cuh — the definition of run_decode (gqa_kernels.hpp), for the .cu files that
// instantiate it: a file per group of policies, so that they compile in parallel.
#pragma once

#include <kvattn/cuda/decode.hpp>
#include <kvattn/cuda/plan.hpp>

#include <vector>

#include "device_cache.cuh"
#include "gqa_kernels.hpp"

namespace cuda_tests {

template <class T, class P>
void run_decode(const kvattn::PagedKvCache<T>& cache, const std::vector<kvattn::SeqId>& seqs, const kvattn::GqaShape& shape,
                const std::vector<float>& q, const kvattn::DecodeParams& p, const P& policy, std::vector<float>& out,
                std::vector<float>& lse) {
  namespace kc = kvattn::cuda;
  const DeviceCacheCopy<T> device(cache, seqs);
  const kvattn::BatchPageTable table = device.page_table();
  kc::DecodePlan plan;
  plan.make(device.cache, table, shape, p);
  kc::PolicyArrays arrays;
  const P device_policy = arrays.upload(policy, plan);
  const kc::DeviceBuffer<float> dq = to_device(q);
  kc::DeviceBuffer<float> dout(out.size()), dlse(lse.size());
  kc::decode(plan.view(device.cache, 0), dq.data(), dout.data(), dlse.data(), plan, nullptr, device_policy);
  kc::check(cudaDeviceSynchronize(), "decode");
  const std::size_t n_out = out.size(), n_lse = lse.size();
  download(out, dout.data(), n_out);
  download(lse, dlse.data(), n_lse);
}

}  // namespace cuda_tests

/// Instantiates run_decode<T, P>.
#define CUDA_TESTS_INSTANTIATE_RUN_DECODE(T, P)                                                                              \
  template void cuda_tests::run_decode<T, P>(const kvattn::PagedKvCache<T>&, const std::vector<kvattn::SeqId>&,               \
                                             const kvattn::GqaShape&, const std::vector<float>&, const kvattn::DecodeParams&, \
                                             const P&, std::vector<float>&, std::vector<float>&);
