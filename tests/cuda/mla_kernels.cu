// tests/cuda/mla_kernels.cu — the device side of mla_kernels.hpp: copies to and from the device
// around kvattn::cuda::mla_decode (Plain; the other policies in mla_policies.cu), and the
// argument checks without a device.
#include <kvattn/cuda/mla_decode.hpp>
#include <kvattn/cuda/plan.hpp>

#include <memory>
#include <vector>

#include "mla_kernels.hpp"
#include "mla_run.cuh"

namespace cuda_tests {

namespace kc = kvattn::cuda;

MlaDecoder::MlaDecoder() : state_(std::make_unique<State>()) {}
MlaDecoder::~MlaDecoder() = default;

std::size_t MlaDecoder::plan_bytes() const { return state_->plan.device_bytes(); }

void mla_decode_without_device(const kvattn::AttentionShape& cache_shape, int view_batch, const kvattn::MlaShape& shape,
                               const kvattn::DecodeParams& p, bool null_q) {
  const kvattn::PagedKvCache<float> cache(kvattn::CacheConfig{1, 4, 1, cache_shape});
  kc::DecodePlan plan;
  plan.make(cache, kvattn::BatchPageTable{}, shape, p);  // an empty batch: no device
  const kvattn::PagedKvView<float> view{nullptr, cache.layout(), nullptr, nullptr, nullptr, view_batch, kvattn::KvScales{}};
  float dummy[1] = {0.0f};
  kc::mla_decode(view, null_q ? nullptr : dummy, dummy, nullptr, plan);
}

}  // namespace cuda_tests

// The element types of a cache.
CUDA_TESTS_INSTANTIATE_MLA_RUN(float, kvattn::Plain)
CUDA_TESTS_INSTANTIATE_MLA_RUN(kvattn::fp16, kvattn::Plain)
CUDA_TESTS_INSTANTIATE_MLA_RUN(kvattn::bf16, kvattn::Plain)
