// tests/cuda/mla_kernels.cu — the device side of mla_kernels.hpp: copies to and from the device
// around kvattn::cuda::mla_decode (Plain, every format; the other policies in mla_policies.cu),
// the argument checks without a device, and the launch geometry.
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

template <class T>
void mla_decode_without_device(const kvattn::AttentionShape& cache_shape, int view_batch, const kvattn::MlaShape& shape,
                               const kvattn::DecodeParams& p, bool null_q) {
  const kvattn::PagedKvCache<T> cache(kvattn::CacheConfig{1, 4, 1, cache_shape});
  kc::DecodePlan plan;
  plan.make(cache, kvattn::BatchPageTable{}, shape, p);  // an empty batch: no device
  const kvattn::PagedKvView<T> view{nullptr, cache.layout(), nullptr, nullptr, nullptr, view_batch, kvattn::KvScales{}};
  float dummy[1] = {0.0f};
  kc::mla_decode(view, null_q ? nullptr : dummy, dummy, nullptr, plan);
}

template <class T> std::size_t mla_block_shared_bytes(const kvattn::MlaShape& shape, int shared_optin) {
  return kc::mla_impl::choose_geometry("mla_block_shared_bytes", shape.latent_dim + shape.rope_dim, shape.latent_dim,
                                       kc::mla_impl::staged_bytes<T>(), shared_optin)
      .shared;
}

#define CUDA_TESTS_INSTANTIATE_MLA_HOST(T)                                                                                       \
  template void mla_decode_without_device<T>(const kvattn::AttentionShape&, int, const kvattn::MlaShape&, const kvattn::DecodeParams&, \
                                             bool);                                                                              \
  template std::size_t mla_block_shared_bytes<T>(const kvattn::MlaShape&, int);
CUDA_TESTS_INSTANTIATE_MLA_HOST(float)
CUDA_TESTS_INSTANTIATE_MLA_HOST(kvattn::fp8_e4m3_latent)
CUDA_TESTS_INSTANTIATE_MLA_HOST(kvattn::int8_latent)
template std::size_t mla_block_shared_bytes<kvattn::bf16>(const kvattn::MlaShape&, int);

}  // namespace cuda_tests

// The formats of a cache.
CUDA_TESTS_INSTANTIATE_MLA_RUN(float, kvattn::Plain)
CUDA_TESTS_INSTANTIATE_MLA_RUN(kvattn::fp16, kvattn::Plain)
CUDA_TESTS_INSTANTIATE_MLA_RUN(kvattn::bf16, kvattn::Plain)
CUDA_TESTS_INSTANTIATE_MLA_RUN(kvattn::fp8_e4m3_latent, kvattn::Plain)
CUDA_TESTS_INSTANTIATE_MLA_RUN(kvattn::int8_latent, kvattn::Plain)
