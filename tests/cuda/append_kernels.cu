// tests/cuda/append_kernels.cu — append_kernels.hpp's calls: the sources to the device, the steps
// on a device cache, its pool back.
#include <kvattn/cuda/append.hpp>

#include <cstdint>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "append_kernels.hpp"
#include "device_cache.cuh"

namespace cuda_tests {

namespace kc = kvattn::cuda;

namespace {
template <class T, class Src>
DeviceReplay replay_from(const kvattn::CacheConfig& config, const std::vector<kvattn::KvScales>& scales,
                         const std::vector<QuantStep>& steps, const std::vector<float>& a, const std::vector<float>& b) {
  std::vector<Src> ha(a.size()), hb(b.size());
  for (std::size_t i = 0; i < a.size(); ++i) ha[i] = kvattn::from_float<Src>(a[i]);
  for (std::size_t i = 0; i < b.size(); ++i) hb[i] = kvattn::from_float<Src>(b[i]);
  kvattn::PagedKvCache<T, kc::DeviceMemory> cache(config, scales);
  const kc::DeviceBuffer<Src> da = to_device(ha), db = to_device(hb);
  kc::AppendWorkspace ws;
  DeviceReplay r;
  std::vector<kvattn::SeqId> seqs;
  constexpr bool kLatent = kvattn::format_traits<T>::latent_block > 0;
  std::size_t wa = 0, wb = 0;  // source values per token
  if constexpr (kLatent) {
    const auto& m = std::get<kvattn::MlaShape>(config.shape);
    wa = static_cast<std::size_t>(m.latent_dim);
    wb = static_cast<std::size_t>(m.rope_dim);
  } else {
    const auto& g = std::get<kvattn::GqaShape>(config.shape);
    wa = wb = static_cast<std::size_t>(g.kv_heads) * g.head_dim;
  }
  r.error = replay(cache, steps, seqs, [&](kvattn::SeqId seq, const QuantStep& s, std::size_t row) {
    if constexpr (kLatent)
      kc::write_latent(cache, seq, s.layer, s.first, s.count, da.data() + row * wa, db.data() + row * wb, ws);
    else
      kc::write_kv(cache, seq, s.layer, s.first, s.count, da.data() + row * wa, db.data() + row * wb, ws);
  });
  kc::check(cudaDeviceSynchronize(), "replay");
  r.non_finite = ws.take_non_finite();
  download(r.pool, reinterpret_cast<const unsigned char*>(cache.data()), cache.pool_bytes());
  for (kvattn::SeqId s : seqs) r.tables.push_back(cache.pages(s));
  return r;
}
}  // namespace

template <class T>
DeviceReplay replay_on_device_quantized(const kvattn::CacheConfig& config, const std::vector<kvattn::KvScales>& scales,
                                        const std::vector<QuantStep>& steps, Source source, const std::vector<float>& a,
                                        const std::vector<float>& b) {
  switch (source) {
    case Source::fp16: return replay_from<T, kvattn::fp16>(config, scales, steps, a, b);
    case Source::bf16: return replay_from<T, kvattn::bf16>(config, scales, steps, a, b);
    default: return replay_from<T, float>(config, scales, steps, a, b);
  }
}

#define KVATTN_INSTANTIATE(T)                                                                                            \
  template DeviceReplay replay_on_device_quantized<T>(const kvattn::CacheConfig&, const std::vector<kvattn::KvScales>&, \
                                                      const std::vector<QuantStep>&, Source, const std::vector<float>&,  \
                                                      const std::vector<float>&);
KVATTN_INSTANTIATE(kvattn::int8_row)
KVATTN_INSTANTIATE(kvattn::fp8_e4m3_row)
KVATTN_INSTANTIATE(kvattn::fp8_e4m3_layer)
KVATTN_INSTANTIATE(kvattn::fp8_e4m3_latent)
KVATTN_INSTANTIATE(kvattn::int8_latent)
#undef KVATTN_INSTANTIATE

}  // namespace cuda_tests
