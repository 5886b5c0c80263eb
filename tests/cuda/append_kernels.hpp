// tests/cuda/append_kernels.hpp — cuda::write_kv and cuda::write_latent into the 8-bit formats'
// device caches behind plain C++ calls on host data, so that the tests compare with the host
// cache's writes in the host compiler. Defined in append_kernels.cu (nvcc).
#pragma once

#include <kvattn/core.hpp>
#include <kvattn/paged_cache.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "gqa_kernels.hpp"

namespace cuda_tests {

/// A step of the tests: gqa_kernels.hpp's AppendStep, replayed by its replay().
using QuantStep = AppendStep;

/// The element type of the sources a test writes from.
enum class Source { fp32, fp16, bf16 };

/// What replay_on_device_quantized gives back.
struct DeviceReplay {
  std::vector<unsigned char> pool;                 ///< the device cache's whole pool, [pool_bytes()]
  std::vector<std::vector<kvattn::PageId>> tables;  ///< the page ids of each sequence made
  std::string error;                               ///< the message of the step that threw ("" if none)
  unsigned long long non_finite = 0;               ///< AppendWorkspace::take_non_finite after the replay
};

/// Replays `steps` on a PagedKvCache<T, cuda::DeviceMemory> made with `config` and `scales`.
/// Writes go through cuda::write_kv (GQA-family formats: a, b are the keys and values
/// [rows][kv_heads][head_dim]) or cuda::write_latent (MLA formats: a, b are the latents
/// [rows][latent_dim] and rotary keys [rows][rope_dim]), the sources converted from float to
/// `source` on the host first (kvattn::from_float), rows taken in order. Instantiated for
/// int8_row, fp8_e4m3_row, fp8_e4m3_layer, fp8_e4m3_latent and int8_latent.
template <class T>
DeviceReplay replay_on_device_quantized(const kvattn::CacheConfig& config, const std::vector<kvattn::KvScales>& scales,
                                        const std::vector<QuantStep>& steps, Source source, const std::vector<float>& a,
                                        const std::vector<float>& b);

}  // namespace cuda_tests
