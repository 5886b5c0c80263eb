// bench/prefill.cpp — causal prefill: FLOP/s against the machine's fp32 FMA peak (printed by
// KVATTN_BENCHMARK_MAIN in the same run), kvattn beside a straightforward Eigen implementation.
//
//   prefill/kvattn/<dtype>/tokens:N/threads:T   kvattn::prefill of one N-token prompt, 32 query
//       heads / 8 KV heads / head size 128, one layer, K/V stored as <dtype> (bf16, fp16, or the
//       8-bit formats int8, fp8 and fp8_layer: int8_row, fp8_e4m3_row, fp8_e4m3_layer, whose
//       layer scales are 1). The step's
//       PrefillPlan is made once, before the timing loop (as an engine makes it once per step
//       for every layer); each timed call writes the layer's K/V and attends.
//   prefill/kvattn_compiled/<dtype>/tokens:N/threads:T   the same kernels called through the
//       compiled kernels' dispatcher (kvattn::kernels::prefill, the kvattn::kernels library:
//       built with the benchmarks where KVATTN_BUILD_KERNELS is on), labelled with the
//       instruction set it chose
//   prefill/eigen/<dtype>/tokens:N/threads:T    the same attention as a user would write it with
//       Eigen: per query head, S = Q·Kᵀ (N × N, materialized), causal mask, row softmax, O = P·V
//       (Eigen's GEMMs; heads shared over the threads).
// FLOP counted for both: the causal half of QKᵀ and PV, 2 · 2 · head_dim · N(N+1)/2 per query
// head (the baseline computes the full N × N and is credited only with the useful half).
// The keys and values are written into the cache outside the timed region (append and the
// conversion are measured in bench_paged_cache).
// GCC 12 reports -Wmaybe-uninitialized inside Eigen's own AVX-512 GEMM packing once it is
// inlined here (GCC bug 105593, a false positive); the baseline's GEMMs are the only cause.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"  // the same, as -O1 and -O2 report it
#endif

#include "bench_common.hpp"

#include <kvattn/prefill.hpp>
#if KVATTN_BENCH_KERNELS
#include <kvattn/kernels.hpp>
#endif

#include <Eigen/Core>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace {

constexpr int kHeads = 32, kKvHeads = 8, kDim = 128;
const kvattn::GqaShape kShape = kvattn::GqaShape::gqa(kHeads, kKvHeads, kDim);

double causal_flops(std::int64_t n) { return 4.0 * kDim * kHeads * (double(n) * (n + 1) / 2); }

struct Inputs {
  std::vector<float> q, k, v, out;
};
Inputs make_inputs(std::int64_t n) {
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  Inputs in;
  in.q.resize(static_cast<std::size_t>(n) * kHeads * kDim);
  in.k.resize(static_cast<std::size_t>(n) * kKvHeads * kDim);
  in.v.resize(in.k.size());
  in.out.resize(in.q.size());
  for (auto* x : {&in.q, &in.k, &in.v})
    for (float& e : *x) e = d(rng);
  return in;
}

/// How a kvattn row calls prefill: instantiated here (kvattn/prefill.hpp, for this program's
/// flags) or through the compiled kernels' dispatcher (kvattn/kernels.hpp).
enum class Way { header, compiled };

template <class T, Way How = Way::header> void kvattn_prefill(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  Inputs in = make_inputs(n);
  kvattn::PagedKvCache<T> cache(kvattn::CacheConfig{1, 16, (n + 15) / 16, kShape});
  const kvattn::SeqId seq = cache.add_sequence();
  cache.append(seq, n);
  kvattn::ChunkBatch batch;
  batch.add(seq, n);
  kvattn::ThreadPool pool(threads);
  kvattn::PrefillPlan plan;
  plan.make(cache, batch, kShape, kvattn::PrefillParams{}, pool);
  for (auto _ : state) {
    if constexpr (How == Way::header) {
      kvattn::prefill(cache, 0, in.q.data(), in.k.data(), in.v.data(), in.out.data(), nullptr, plan, pool);
    } else {
#if KVATTN_BENCH_KERNELS
      kvattn::kernels::prefill(cache, 0, in.q.data(), in.k.data(), in.v.data(), in.out.data(), nullptr, plan, pool);
#endif
    }
    benchmark::DoNotOptimize(in.out.data());
  }
  kvattn::bench::report_flops(state, causal_flops(n));
  std::string label(kvattn::isa::native::name);
#if KVATTN_BENCH_KERNELS
  if (How == Way::compiled) label = "compiled, " + std::string(kvattn::kernels::isa());
#endif
  state.SetLabel(label);
}

template <class T> void eigen_prefill(benchmark::State& state) {
  using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const std::int64_t n = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  Inputs in = make_inputs(n);
  // The baseline keeps its keys and values as the storage type, contiguous per KV head, and
  // converts them to fp32 for Eigen inside the timed region, as the kernel converts its loads.
  std::vector<T> ks(in.k.size()), vs(in.v.size());
  kvattn::convert_row(in.k.data(), ks.data(), ks.size());
  kvattn::convert_row(in.v.data(), vs.data(), vs.size());
  kvattn::ThreadPool pool(threads);
  const float scale = 1.0f / std::sqrt(float(kDim));
  for (auto _ : state) {
    pool(kHeads, [&](std::int64_t h) {
      const int g = static_cast<int>(h) / (kHeads / kKvHeads);
      Mat Q(n, kDim), K(n, kDim), V(n, kDim);
      for (std::int64_t t = 0; t < n; ++t)
        for (int d = 0; d < kDim; ++d) {
          Q(t, d) = in.q[static_cast<std::size_t>((t * kHeads + h) * kDim + d)];
          K(t, d) = static_cast<float>(ks[static_cast<std::size_t>((t * kKvHeads + g) * kDim + d)]);
          V(t, d) = static_cast<float>(vs[static_cast<std::size_t>((t * kKvHeads + g) * kDim + d)]);
        }
      Mat S = (Q * K.transpose()) * scale;
      for (std::int64_t i = 0; i < n; ++i) {
        auto row = S.row(i);
        for (std::int64_t j = i + 1; j < n; ++j) row(j) = -INFINITY;
        const float m = row.maxCoeff();
        row = (row.array() - m).exp();
        row /= row.sum();
      }
      const Mat O = S * V;
      for (std::int64_t t = 0; t < n; ++t)
        for (int d = 0; d < kDim; ++d) in.out[static_cast<std::size_t>((t * kHeads + h) * kDim + d)] = O(t, d);
    });
    benchmark::DoNotOptimize(in.out.data());
  }
  kvattn::bench::report_flops(state, causal_flops(n));
}

void args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"tokens", "threads"});
  for (int n : {2048, 4096})
    for (int t : {1, 2}) b->Args({n, t});
  b->UseRealTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK(kvattn_prefill<kvattn::bf16>)->Name("prefill/kvattn/bf16")->Apply(args);
BENCHMARK(kvattn_prefill<kvattn::fp16>)->Name("prefill/kvattn/fp16")->Apply(args);
#if KVATTN_BENCH_KERNELS
// The same kernels through the dispatcher, beside the rows instantiated here.
BENCHMARK(kvattn_prefill<kvattn::bf16, Way::compiled>)->Name("prefill/kvattn_compiled/bf16")->Apply(args);
BENCHMARK(kvattn_prefill<kvattn::fp16, Way::compiled>)->Name("prefill/kvattn_compiled/fp16")->Apply(args);
#endif
// The 8-bit formats (kvattn/format.hpp): each timed call also quantizes the layer's K/V as it
// writes them, and the kernel dequantizes each tile of the cache once; beside bf16's rows.
BENCHMARK(kvattn_prefill<kvattn::int8_row>)->Name("prefill/kvattn/int8")->Apply(args);
BENCHMARK(kvattn_prefill<kvattn::fp8_e4m3_row>)->Name("prefill/kvattn/fp8")->Apply(args);
BENCHMARK(kvattn_prefill<kvattn::fp8_e4m3_layer>)->Name("prefill/kvattn/fp8_layer")->Apply(args);
BENCHMARK(eigen_prefill<kvattn::bf16>)->Name("prefill/eigen/bf16")->Apply(args);

}  // namespace

KVATTN_BENCHMARK_MAIN()
