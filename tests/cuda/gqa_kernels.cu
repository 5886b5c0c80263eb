// tests/cuda/gqa_kernels.cu — gqa_kernels.hpp's calls: host data to the device, one operator, results back.
#include <kvattn/cuda/append.hpp>
#include <kvattn/cuda/decode.hpp>

#include "gqa_kernels.hpp"

namespace cuda_tests {

using kvattn::cuda::check;
using kvattn::cuda::DeviceBuffer;

namespace {
template <class T> void download(std::vector<T>& host, const T* device, std::size_t n) {
  host.resize(n);
  if (n > 0) check(cudaMemcpy(host.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy (download)");
}
}  // namespace

template <class T, class V>
void run_decode(const kvattn::PagedKvCache<T>& cache, const std::vector<kvattn::SeqId>& seqs, const kvattn::GqaShape& shape,
                const std::vector<float>& q, const kvattn::DecodeParams& p, std::vector<float>& out, std::vector<float>& lse) {
  const std::size_t layer_elements = static_cast<std::size_t>(cache.layer_stride());
  DeviceBuffer<T> pool(layer_elements);
  check(cudaMemcpy(pool.data(), cache.layer_data(0), layer_elements * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy (pool)");
  kvattn::cuda::DevicePageTable table;
  table.upload(cache.page_table(seqs));
  DeviceBuffer<float> dq, dout(out.size()), dlse(lse.size());
  dq.upload(q.data(), q.size(), nullptr);
  kvattn::cuda::DecodeWorkspace ws;
  kvattn::cuda::decode<V>(table.view(pool.data(), cache.layout()), table, shape, dq.data(), dout.data(), dlse.data(), p, ws);
  check(cudaDeviceSynchronize(), "decode");
  const std::size_t n_out = out.size(), n_lse = lse.size();
  download(out, dout.data(), n_out);
  download(lse, dlse.data(), n_lse);
}

std::string decode_error(const kvattn::GqaShape& cache_shape, const kvattn::GqaShape& shape, const kvattn::DecodeParams& p,
                         int variant, bool batch_mismatch) {
  const kvattn::cuda::DevicePageTable table;  // empty: nothing on the device
  kvattn::PagedKvView<kvattn::fp16> view = table.view<kvattn::fp16>(nullptr, kvattn::PageLayout::make(cache_shape, 16, 2));
  if (batch_mismatch) view.batch = 1;
  kvattn::cuda::DecodeWorkspace ws;
  try {
    switch (variant) {
      case 1: kvattn::cuda::decode<kvattn::Variant<true, false>>(view, table, shape, nullptr, nullptr, nullptr, p, ws); break;
      case 2: kvattn::cuda::decode<kvattn::Variant<false, true>>(view, table, shape, nullptr, nullptr, nullptr, p, ws); break;
      default: kvattn::cuda::decode(view, table, shape, nullptr, nullptr, nullptr, p, ws); break;
    }
  } catch (const kvattn::invalid_argument& e) {  // (shape_error derives from it)
    return e.what();
  }
  return {};
}

template <class T>
void replay_on_device(const kvattn::CacheConfig& config, const std::vector<AppendStep>& steps, const std::vector<float>& k,
                      const std::vector<float>& v, std::vector<T>& pool, std::vector<std::vector<kvattn::PageId>>& tables,
                      std::string& error) {
  kvattn::PagedKvCache<T, kvattn::cuda::DeviceMemory> cache(config);
  const auto& shape = std::get<kvattn::GqaShape>(config.shape);
  const std::size_t width = static_cast<std::size_t>(shape.kv_heads) * shape.head_dim;  // floats per token
  DeviceBuffer<float> dk, dv;
  dk.upload(k.data(), k.size(), nullptr);
  dv.upload(v.data(), v.size(), nullptr);
  kvattn::cuda::AppendWorkspace ws;
  std::vector<kvattn::SeqId> seqs;
  error = replay(cache, steps, seqs, [&](kvattn::SeqId seq, const AppendStep& s, std::size_t row) {
    kvattn::cuda::write_kv(cache, seq, s.layer, s.first, s.count, dk.data() + row * width, dv.data() + row * width, ws);
  });
  check(cudaDeviceSynchronize(), "replay");
  download(pool, cache.data(), cache.pool_bytes() / sizeof(T));
  tables.clear();
  for (kvattn::SeqId s : seqs) tables.push_back(cache.pages(s));
}

#define KVATTN_INSTANTIATE(T)                                                                                       \
  template void run_decode<T, kvattn::Plain>(const kvattn::PagedKvCache<T>&, const std::vector<kvattn::SeqId>&,     \
                                             const kvattn::GqaShape&, const std::vector<float>&,                    \
                                             const kvattn::DecodeParams&, std::vector<float>&, std::vector<float>&); \
  template void replay_on_device<T>(const kvattn::CacheConfig&, const std::vector<AppendStep>&, const std::vector<float>&, \
                                    const std::vector<float>&, std::vector<T>&, std::vector<std::vector<kvattn::PageId>>&, \
                                    std::string&);
KVATTN_INSTANTIATE(float)
KVATTN_INSTANTIATE(kvattn::fp16)
KVATTN_INSTANTIATE(kvattn::bf16)
#undef KVATTN_INSTANTIATE

// The variants, on one storage type (their kernels differ from the plain one only in the masks).
#define KVATTN_INSTANTIATE_VARIANT(V)                                                                          \
  template void run_decode<kvattn::fp16, V>(const kvattn::PagedKvCache<kvattn::fp16>&,                          \
                                            const std::vector<kvattn::SeqId>&, const kvattn::GqaShape&,         \
                                            const std::vector<float>&, const kvattn::DecodeParams&,             \
                                            std::vector<float>&, std::vector<float>&);
using Window = kvattn::Variant<true, false>;
using Cap = kvattn::Variant<false, true>;
using WindowCap = kvattn::Variant<true, true>;
KVATTN_INSTANTIATE_VARIANT(Window)
KVATTN_INSTANTIATE_VARIANT(Cap)
KVATTN_INSTANTIATE_VARIANT(WindowCap)
#undef KVATTN_INSTANTIATE_VARIANT

}  // namespace cuda_tests
