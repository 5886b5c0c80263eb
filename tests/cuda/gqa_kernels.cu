// tests/cuda/gqa_kernels.cu — gqa_kernels.hpp's calls: host data to the device, one operator,
// results back; the argument checks; the append kernels. The policies other than Plain are
// instantiated in gqa_policies.cu.
#include <kvattn/cuda/append.hpp>
#include <kvattn/cuda/decode.hpp>
#include <kvattn/cuda/plan.hpp>

#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "device_cache.cuh"
#include "gqa_kernels.hpp"
#include "gqa_run.cuh"

namespace cuda_tests {

namespace kc = kvattn::cuda;
using kc::check;
using kc::DeviceBuffer;

namespace {
/// A host cache of `shape`: one layer of 4 pages of 16 fp16 tokens (for the checks of the plan,
/// which reads only a cache's bookkeeping).
kvattn::PagedKvCache<kvattn::fp16> host_cache(const kvattn::AttentionShape& shape) {
  return kvattn::PagedKvCache<kvattn::fp16>(kvattn::CacheConfig{1, 16, 4, shape});
}
}  // namespace

std::string decode_error(const kvattn::GqaShape& shape, DecodeMisuse misuse) {
  try {
    const auto cache = host_cache(shape);
    kc::DecodePlan plan;
    if (misuse == DecodeMisuse::mla_plan) {
      const kvattn::MlaShape mla{shape.q_heads, 64, 8, 16, 16, 0};
      const auto mla_cache = host_cache(mla);
      plan.make(mla_cache, kvattn::BatchPageTable{}, mla, kvattn::DecodeParams{});
      const kvattn::PagedKvView<kvattn::fp16> view{nullptr, mla_cache.layout(), nullptr, nullptr, nullptr, 0, kvattn::KvScales{}};
      kc::decode(view, nullptr, nullptr, nullptr, plan);
      return {};
    }
    if (misuse != DecodeMisuse::never_made) plan.make(cache, kvattn::BatchPageTable{}, shape, kvattn::DecodeParams{});
    // The plan's view of an empty batch: no device arrays (DecodePlan::view needs a device cache).
    const kvattn::PagedKvView<kvattn::fp16> view{nullptr, cache.layout(), nullptr, nullptr, nullptr,
                                                 misuse == DecodeMisuse::batch_mismatch ? 1 : 0, kvattn::KvScales{}};
    const float slopes[1] = {0.0f};
    const std::uint64_t bits[3] = {1, 1, 1};
    switch (misuse) {
      case DecodeMisuse::window_zero: kc::decode(view, nullptr, nullptr, nullptr, plan, nullptr, kvattn::SlidingWindow{0}); break;
      case DecodeMisuse::cap_zero: kc::decode(view, nullptr, nullptr, nullptr, plan, nullptr, kvattn::SoftCap{0.0f}); break;
      case DecodeMisuse::alibi_heads:
        kc::decode(view, nullptr, nullptr, nullptr, plan, nullptr, kvattn::Alibi{slopes, shape.q_heads + 1});
        break;
      case DecodeMisuse::tree_rows: kc::decode(view, nullptr, nullptr, nullptr, plan, nullptr, kvattn::TreeMask{bits, 3}); break;
      default: kc::decode(view, nullptr, nullptr, nullptr, plan); break;
    }
  } catch (const kvattn::invalid_argument& e) {  // (shape_error derives from it)
    return e.what();
  }
  return {};
}

std::string plan_error(const kvattn::GqaShape& cache_shape, const kvattn::GqaShape& shape, const kvattn::DecodeParams& p,
                       const kvattn::BatchPageTable& table) {
  try {
    const auto cache = host_cache(cache_shape);
    kc::DecodePlan plan;
    plan.make(cache, table, shape, p);
  } catch (const kvattn::invalid_argument& e) {
    return e.what();
  }
  return {};
}

template <class P> std::string upload_error(const P& policy, int q_heads, std::int64_t rows) {
  const std::int64_t indptr[2] = {0, rows};
  try {
    kc::PolicyArrays arrays;
    (void)arrays.upload(policy, kvattn::PolicyCall{q_heads, 1, indptr});
  } catch (const kvattn::invalid_argument& e) {
    return e.what();
  }
  return "(no error)";
}
template std::string upload_error<kvattn::Alibi>(const kvattn::Alibi&, int, std::int64_t);
template std::string upload_error<kvattn::Sinks>(const kvattn::Sinks&, int, std::int64_t);
template std::string upload_error<kvattn::TreeMask>(const kvattn::TreeMask&, int, std::int64_t);
template std::string upload_error<kvattn::Compose<kvattn::SlidingWindow, kvattn::Sinks>>(
    const kvattn::Compose<kvattn::SlidingWindow, kvattn::Sinks>&, int, std::int64_t);

std::vector<std::string> view_errors() {
  const kvattn::GqaShape shape = kvattn::GqaShape::gqa(4, 2, 64);
  const kvattn::CacheConfig config{2, 16, 8, shape};
  kvattn::PagedKvCache<kvattn::fp16, kc::DeviceMemory> cache(config), other(config);
  const kvattn::SeqId seq = cache.add_sequence();
  cache.append(seq, 20);
  kc::DecodePlan plan;
  plan.make(cache, cache.page_table({seq}), shape, kvattn::DecodeParams{});
  std::vector<std::string> errors;
  const auto message = [&](auto&& f) {
    try {
      f();
    } catch (const kvattn::invalid_argument& e) {
      errors.push_back(e.what());
      return;
    }
    errors.push_back("(no error)");
  };
  message([&] { (void)plan.view(other, 0); });
  message([&] { (void)plan.view(cache, 2); });
  message([&] { (void)plan.view(cache, 1); });  // fine: "(no error)"
  cache.append(seq, 1);
  message([&] { (void)plan.view(cache, 0); });
  check(cudaDeviceSynchronize(), "view_errors");
  return errors;
}

template <class T>
void replay_on_device(const kvattn::CacheConfig& config, const std::vector<AppendStep>& steps, const std::vector<float>& k,
                      const std::vector<float>& v, std::vector<T>& pool, std::vector<std::vector<kvattn::PageId>>& tables,
                      std::string& error) {
  kvattn::PagedKvCache<T, kc::DeviceMemory> cache(config);
  const auto& shape = std::get<kvattn::GqaShape>(config.shape);
  const std::size_t width = static_cast<std::size_t>(shape.kv_heads) * shape.head_dim;  // floats per token
  const DeviceBuffer<float> dk = to_device(k), dv = to_device(v);
  kc::AppendWorkspace ws;
  std::vector<kvattn::SeqId> seqs;
  error = replay(cache, steps, seqs, [&](kvattn::SeqId seq, const AppendStep& s, std::size_t row) {
    kc::write_kv(cache, seq, s.layer, s.first, s.count, dk.data() + row * width, dv.data() + row * width, ws);
  });
  check(cudaDeviceSynchronize(), "replay");
  download(pool, cache.data(), cache.pool_bytes() / sizeof(T));
  tables.clear();
  for (kvattn::SeqId s : seqs) tables.push_back(cache.pages(s));
}

#define KVATTN_INSTANTIATE(T)                                                                                              \
  template void replay_on_device<T>(const kvattn::CacheConfig&, const std::vector<AppendStep>&, const std::vector<float>&, \
                                    const std::vector<float>&, std::vector<T>&, std::vector<std::vector<kvattn::PageId>>&, \
                                    std::string&);
KVATTN_INSTANTIATE(float)
KVATTN_INSTANTIATE(kvattn::fp16)
KVATTN_INSTANTIATE(kvattn::bf16)
#undef KVATTN_INSTANTIATE

}  // namespace cuda_tests

CUDA_TESTS_INSTANTIATE_RUN_DECODE(float, kvattn::Plain)
CUDA_TESTS_INSTANTIATE_RUN_DECODE(kvattn::fp16, kvattn::Plain)
CUDA_TESTS_INSTANTIATE_RUN_DECODE(kvattn::bf16, kvattn::Plain)
