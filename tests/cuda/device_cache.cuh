// tests/cuda/device_cache.cuh — for the .cu files of the CUDA tests: a device cache holding what a
// host cache holds, and host <-> device copies of test arrays.
#pragma once

#include <kvattn/cuda/runtime.hpp>
#include <kvattn/paged_cache.hpp>

#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

namespace cuda_tests {

/// Copies n elements from the device to `host` (resized), waiting for the device.
template <class T> void download(std::vector<T>& host, const T* device, std::size_t n) {
  host.resize(n);
  if (n > 0)
    kvattn::cuda::check(cudaMemcpy(host.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy (download)");
}

/// A device array holding `host`'s elements (copied before it returns).
template <class T> kvattn::cuda::DeviceBuffer<T> to_device(const std::vector<T>& host) {
  kvattn::cuda::DeviceBuffer<T> d(host.size());
  if (!host.empty())
    kvattn::cuda::check(cudaMemcpy(d.data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy (to_device)");
  return d;
}

/// A PagedKvCache<T, cuda::DeviceMemory> holding what `host` holds for `host_seqs`: the same
/// sequences made in the same order in a cache of the same configuration (so the same pages: the
/// test inputs make each sequence of a fresh cache in turn, which the constructor checks), and
/// the whole pool copied byte for byte (scale blocks included; a format's layer scales given to
/// the device cache as the host cache holds them). seqs[b] is host_seqs[b]'s id in the device cache.
template <class T> struct DeviceCacheCopy {
  kvattn::PagedKvCache<T, kvattn::cuda::DeviceMemory> cache;
  std::vector<kvattn::SeqId> seqs;

  DeviceCacheCopy(const kvattn::PagedKvCache<T>& host, const std::vector<kvattn::SeqId>& host_seqs)
      : cache(host.config(), layer_scales(host)) {
    for (kvattn::SeqId s : host_seqs) {
      const kvattn::SeqId d = cache.add_sequence();
      seqs.push_back(d);
      if (host.length(s) > 0) cache.append(d, host.length(s));
      if (cache.pages(d) != host.pages(s))
        throw std::logic_error("DeviceCacheCopy: sequence " + std::to_string(s) +
                               " holds other pages in the device cache (the host cache was not made sequence by sequence)");
    }
    kvattn::cuda::check(cudaMemcpy(cache.layer_data(0), host.data(), host.pool_bytes(), cudaMemcpyHostToDevice),
                        "cudaMemcpy (cache pool)");
  }
  kvattn::BatchPageTable page_table() const { return cache.page_table(seqs); }

 private:
  static std::vector<kvattn::KvScales> layer_scales(const kvattn::PagedKvCache<T>& host) {  // (formats with one per layer)
    std::vector<kvattn::KvScales> s;
    if constexpr (kvattn::PagedKvCache<T>::kLayerScale)
      for (int l = 0; l < host.config().layers; ++l) s.push_back(host.scales(l));
    return s;
  }
};

}  // namespace cuda_tests
