// bench/mla.cpp — MLA decode on DeepSeek-V2's head layout (128 heads, latent 512, rotary 64,
// heads of 128; bf16 latents, pages of 16 tokens), one query per sequence per step:
//
//   mla/folded/bf16/ctx:C/batch:B/threads:N     mla_decode: scores straight against the cached
//       latents, values mixed in latent space (the step's DecodePlan made once, before the
//       timing loop, and reused by every timed call, as by every layer of an engine's step).
//       FLOP/s = 2 · heads · (576 + 512) per token and sequence (compare with
//       machine/fma_peak_f32 for N threads, printed at the end of the same run);
//       bytes_per_second = cached bytes read (576 bf16 per token).
//   mla/folded/fp8_latent/..., mla/folded/int8_latent/...   the same over a cache of an MLA
//       format (format.hpp: the latent in fp8 e4m3 or int8 in blocks of 128 with an fp32 scale
//       each, the rotary key in bf16; 656 bytes per token), beside bf16's rows.
//   mla/folded_compiled/bf16/..., mla/folded_compiled/fp8_latent/...   the same kernels called
//       through the compiled kernels' dispatcher (kvattn::kernels::mla_decode, the
//       kvattn::kernels library: built with the benchmarks where KVATTN_BUILD_KERNELS is on),
//       labelled with the instruction set it chose.
//   mla/unfolded/bf16/ctx:C/batch:1/threads:N   the same step the unfolded way: every token's
//       per-head key (W_UK,i c) and value (W_UV,i c) rebuilt from its latent with Eigen
//       (matrix products), then each head's attention; heads shared out among the threads.
//       Its FLOP/s counts the rebuild and the attention.
//   mla/mha128/bf16/ctx:C/batch:B/threads:N     decode() with 128 MHA heads of 128 at the same
//       context (its plan made once, as for mla/folded): what the cache would hold and read
//       without the latent (bytes_per_second against machine/read_bandwidth).
//
// Time per step is each benchmark's Time column (ms), so the three can be compared directly at
// the same ctx, batch and threads. The absorption of the query (W_UK,iᵀ q_i^C) and the output's
// W_UV,i, which the folded step adds, are 2 · 128 · 128 · 512 multiply-adds per sequence (about
// 0.1 ms at 200 GFLOP/s): not included in mla/folded.
// A filter: --benchmark_filter='mla/folded/bf16/ctx:4096' (-machine/ leaves the limits out).
// GCC 12 reports -Wmaybe-uninitialized inside Eigen's AVX-512 GEMM code once it is inlined here
// (GCC bug 105593, a false positive; as in bench/prefill.cpp).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"  // the same, as -O1 and -O2 report it
#endif

#include "bench_common.hpp"

#include <kvattn/decode.hpp>
#include <kvattn/mla_decode.hpp>
#if KVATTN_BENCH_KERNELS
#include <kvattn/kernels.hpp>
#endif
#include <kvattn/paged_cache.hpp>
#include <kvattn/parallel.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using kvattn::bf16;
using kvattn::MlaShape;
using kvattn::PagedKvCache;

constexpr int kPage = 16;
const MlaShape kShape{128, 512, 64, 128, 128, 1536};  // DeepSeek-V2
constexpr int kK = 512 + 64;                          // cached elements per token
constexpr std::int64_t kContexts[] = {1024, 4096, 8192, 16384, 32768};
constexpr std::int64_t kUnfoldedContexts[] = {1024, 8192};
constexpr int kBatches[] = {1, 8};
constexpr int kThreads[] = {1, 2};
constexpr std::int64_t kMhaMaxBytes = std::int64_t{2} << 30;  // K/V of the MHA configurations, at most

using kvattn::bench::shared_pool;
using kvattn::bench::with_parallel_for;

std::vector<float> normal(std::size_t n, unsigned seed, float sd = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, sd);
  std::vector<float> v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

/// A one-layer cache of format T of `batch` sequences of `ctx` tokens, kept for the next
/// benchmark of the same configuration (one at a time): for bf16, random elements in ±[1/8, 2);
/// for an MLA format, 64 rows of random latents and rotary keys written in turn.
template <class Shape, class T = bf16> struct Filled {
  std::unique_ptr<PagedKvCache<T>> cache;
  kvattn::BatchPageTable table;

  static Filled& get(const Shape& shape, std::int64_t ctx, std::int64_t batch) {
    static std::map<std::string, Filled> kept;
    const std::string key = std::to_string(ctx) + "/" + std::to_string(batch);
    if (auto it = kept.find(key); it != kept.end()) return it->second;
    kept.clear();
    Filled& f = kept[key];
    const std::int64_t pages = batch * ((ctx + kPage - 1) / kPage);
    f.cache = std::make_unique<PagedKvCache<T>>(kvattn::CacheConfig{1, kPage, pages, shape});
    std::vector<kvattn::SeqId> seqs;
    for (std::int64_t b = 0; b < batch; ++b) {
      seqs.push_back(f.cache->add_sequence());
      f.cache->append(seqs.back(), ctx);
    }
    f.table = f.cache->page_table(seqs);
    if constexpr (!std::is_same_v<T, bf16>) {
      const MlaShape& m = shape;
      const auto latent = normal(std::size_t{64} * m.latent_dim, 4), rope = normal(std::size_t{64} * m.rope_dim, 5);
      for (kvattn::SeqId s : seqs)
        for (std::int64_t t = 0; t < ctx; ++t)
          f.cache->write_latent(s, 0, t, &latent[std::size_t(t % 64) * m.latent_dim], &rope[std::size_t(t % 64) * m.rope_dim]);
      return f;
    }
    T* data = f.cache->layer_data(0);
    const std::int64_t n = pages * f.cache->layout().page_stride;
    std::uint64_t x = 0x9E3779B97F4A7C15ull;
    for (std::int64_t i = 0; i < n; ++i) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      const auto bits = static_cast<std::uint16_t>((x & 0x81FFu) | 0x3E00u);  // s|0111 11xx|xxxx xxx
      std::memcpy(static_cast<void*>(data + i), &bits, sizeof bits);
    }
    return f;
  }
  kvattn::PagedKvView<T> view() const { return cache->view(table, 0); }
};

double folded_flops(std::int64_t batch, std::int64_t ctx) {
  return 2.0 * double(batch) * double(ctx) * kShape.heads * (kK + kShape.latent_dim);
}

/// How bm_folded calls mla_decode: instantiated here (kvattn/mla_decode.hpp, for this program's
/// flags) or through the compiled kernels' dispatcher (kvattn/kernels.hpp).
enum class Way { header, compiled };

template <class T = bf16, Way How = Way::header> void bm_folded(benchmark::State& state) {
  const std::int64_t ctx = state.range(0), batch = state.range(1);
  const int threads = static_cast<int>(state.range(2));
  const auto& f = Filled<MlaShape, T>::get(kShape, ctx, batch);
  const auto q = normal(std::size_t(batch) * kShape.heads * kK, 1, 0.3f);
  std::vector<float> out(std::size_t(batch) * kShape.heads * kShape.latent_dim);
  kvattn::DecodePlan plan;
  with_parallel_for(threads, [&](auto&& pf) {
    plan.make(f.view(), kShape, kvattn::DecodeParams{}, pf);  // the step's plan, once
    for (auto _ : state) {
      if constexpr (How == Way::header) {
        kvattn::mla_decode(f.view(), q.data(), out.data(), nullptr, plan, pf);
      } else {
#if KVATTN_BENCH_KERNELS
        kvattn::kernels::mla_decode(f.view(), q.data(), out.data(), nullptr, plan, pf);
#endif
      }
      benchmark::ClobberMemory();
    }
  });
  kvattn::bench::report_flops(state, folded_flops(batch, ctx));
  kvattn::bench::report_bytes(state, batch * ctx * f.cache->layout().token_bytes());
  std::string label(kvattn::isa::native::name);
#if KVATTN_BENCH_KERNELS
  if (How == Way::compiled) label = "compiled, " + std::string(kvattn::kernels::isa());
#endif
  state.SetLabel(label);
}

/// One step the unfolded way, for one sequence: latents to fp32, then per head: keys and values
/// rebuilt (two matrix products of ctx × 512 by 512 × 128), scores, softmax, output.
void bm_unfolded(benchmark::State& state) {
  using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const std::int64_t ctx = state.range(0);
  const int threads = static_cast<int>(state.range(2));
  const auto& f = Filled<MlaShape>::get(kShape, ctx, 1);
  const int H = kShape.heads, Dc = kShape.latent_dim, Dr = kShape.rope_dim, D = kShape.nope_dim;
  const auto wk = normal(std::size_t(H) * D * Dc, 2, 0.04f), wv = normal(std::size_t(H) * D * Dc, 3, 0.04f);
  const auto q = normal(std::size_t(H) * (D + Dr), 4, 0.3f);
  std::vector<float> out(std::size_t(H) * D);
  Matrix lat(ctx, Dc), kr(ctx, Dr);
  struct Scratch {
    Matrix k, v;
    Eigen::VectorXf s;
  };
  std::vector<Scratch> scratch(static_cast<std::size_t>(threads));
  const kvattn::PagedKvView<bf16> view = f.view();
  const float scale = 1.0f / std::sqrt(float(D + Dr));
  with_parallel_for(threads, [&](auto&& pf) {
    for (auto _ : state) {
      pf(threads, [&](std::int64_t part) {  // the latents, read from their pages
        for (std::int64_t t = part; t < ctx; t += threads) {
          const bf16* row = view.page(view.indices[t / kPage]) + view.layout.latent(static_cast<int>(t % kPage));
          kvattn::convert_row(row, lat.row(t).data(), static_cast<std::size_t>(Dc));
          kvattn::convert_row(row + Dc, kr.row(t).data(), static_cast<std::size_t>(Dr));
        }
      });
      pf(threads, [&](std::int64_t part) {
        Scratch& s = scratch[static_cast<std::size_t>(part)];
        for (int h = static_cast<int>(part); h < H; h += threads) {
          const Eigen::Map<const Matrix> wkh(wk.data() + std::size_t(h) * D * Dc, D, Dc), wvh(wv.data() + std::size_t(h) * D * Dc, D, Dc);
          s.k.noalias() = lat * wkh.transpose();
          s.v.noalias() = lat * wvh.transpose();
          const Eigen::Map<const Eigen::VectorXf> qc(q.data() + std::size_t(h) * (D + Dr), D), qr(q.data() + std::size_t(h) * (D + Dr) + D, Dr);
          s.s.noalias() = s.k * qc;
          s.s.noalias() += kr * qr;
          s.s *= scale;
          s.s = (s.s.array() - s.s.maxCoeff()).exp().matrix();
          s.s /= s.s.sum();
          Eigen::Map<Eigen::VectorXf>(out.data() + std::size_t(h) * D, D).noalias() = s.v.transpose() * s.s;
        }
      });
      benchmark::ClobberMemory();
    }
  });
  const double rebuild = 2.0 * 2.0 * double(ctx) * Dc * D * H, attention = 2.0 * double(ctx) * H * (D + Dr + D);
  kvattn::bench::report_flops(state, rebuild + attention);
  kvattn::bench::report_bytes(state, ctx * kK * 2);
}

void bm_mha(benchmark::State& state) {
  const std::int64_t ctx = state.range(0), batch = state.range(1);
  const int threads = static_cast<int>(state.range(2));
  const kvattn::GqaShape shape = kvattn::GqaShape::mha(kShape.heads, kShape.nope_dim);
  const auto& f = Filled<kvattn::GqaShape>::get(shape, ctx, batch);
  const auto q = normal(std::size_t(batch) * shape.q_heads * shape.head_dim, 5);
  std::vector<float> out(q.size());
  kvattn::DecodePlan plan;
  with_parallel_for(threads, [&](auto&& pf) {
    plan.make(f.view(), shape, kvattn::DecodeParams{}, pf);  // the step's plan, once
    for (auto _ : state) {
      kvattn::decode(f.view(), q.data(), out.data(), nullptr, plan, pf);
      benchmark::ClobberMemory();
    }
  });
  kvattn::bench::report_bytes(state, batch * ctx * shape.q_heads * shape.head_dim * 2 * 2);
}

const bool registered = [] {
  const auto setup = [](benchmark::internal::Benchmark* b) {
    b->ArgNames({"ctx", "batch", "threads"})->UseRealTime()->Unit(benchmark::kMillisecond);
  };
  auto* folded = benchmark::RegisterBenchmark("mla/folded/bf16", bm_folded<bf16>);
  auto* fp8 = benchmark::RegisterBenchmark("mla/folded/fp8_latent", bm_folded<kvattn::fp8_e4m3_latent>);
  auto* int8 = benchmark::RegisterBenchmark("mla/folded/int8_latent", bm_folded<kvattn::int8_latent>);
  auto* unfolded = benchmark::RegisterBenchmark("mla/unfolded/bf16", bm_unfolded);
  auto* mha = benchmark::RegisterBenchmark("mla/mha128/bf16", bm_mha);
  std::vector<benchmark::internal::Benchmark*> folded_rows{folded, fp8, int8};
#if KVATTN_BENCH_KERNELS
  // The same kernels through the dispatcher, beside the rows instantiated here.
  folded_rows.push_back(benchmark::RegisterBenchmark("mla/folded_compiled/bf16", bm_folded<bf16, Way::compiled>));
  folded_rows.push_back(
      benchmark::RegisterBenchmark("mla/folded_compiled/fp8_latent", bm_folded<kvattn::fp8_e4m3_latent, Way::compiled>));
#endif
  for (auto* b : folded_rows) setup(b);
  for (auto* b : {unfolded, mha}) setup(b);
  for (int batch : kBatches)
    for (std::int64_t ctx : kContexts)
      for (int threads : kThreads) {
        for (auto* b : folded_rows) b->Args({ctx, batch, threads});
        if (batch * ctx * std::int64_t{128 * 128 * 2 * 2} <= kMhaMaxBytes) mha->Args({ctx, batch, threads});
      }
  for (std::int64_t ctx : kUnfoldedContexts)
    for (int threads : kThreads) unfolded->Args({ctx, 1, threads});
  return true;
}();

}  // namespace

KVATTN_BENCHMARK_MAIN()
