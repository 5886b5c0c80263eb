// bench/decode.cpp — decode attention (MHA / GQA) over the paged cache: kvattn::decode against a
// straightforward Eigen implementation, both judged by the bytes of K/V they must read.
//
//   decode/<impl>/<shape>/<dtype>/ctx:C/batch:B/threads:N/real_time
//     impl   kvattn: kvattn::decode with kvattn::Plain (SerialFor for N = 1, a ThreadPool of N for
//                    N = 2). The step's DecodePlan is made once, before the timing loop, for
//                    that parallel-for (split-KV chunks chosen by the plan), and every timed call
//                    reuses it, as every layer of an engine's step does.
//            kvattn_compiled: the same kernels called through the compiled kernels'
//                    dispatcher (kvattn::kernels::decode, the kvattn::kernels library: built
//                    for the x86-64 baseline with each instruction set's unit compiled for it,
//                    not -march=native), bf16 and fp16 rows of both shapes; the label names the
//                    instruction set the dispatcher chose;
//            kvattn_sinks: the same with kvattn::Sinks (one sink logit per query head, gpt-oss),
//            kvattn_alibi: the same with kvattn::Alibi (kvattn::alibi_slopes(32), BLOOM / MPT);
//                    gqa32x8 only, at every (C, B, N) of the plain rows, measured and reported
//                    exactly as they are, so that a filter such as
//                    'decode/kvattn.*/gqa32x8/bf16/ctx:16384' puts a policy's cost beside plain.
//            kvattn_i8q: the plain kernel on int8 rows (both shapes) with
//                    DecodeParams::int8_queries: int8 keys scored against int8 queries, by
//                    integer dot products where the ISA has them; beside kvattn's int8 rows;
//            kvattn_i8qp: the same with DecodeParams::u8_probabilities too (values weighed
//                    by 8-bit probabilities, also by integer dot products).
//            eigen:  the baseline a user would write with Eigen (eigen_attend below): for every
//                    sequence and query head, gather that head's K and V rows page by page into
//                    contiguous float matrices (Eigen's vectorized cast), scores = K · q (GEMV),
//                    softmax (max, exp, sum), out = Vᵀ · p. With GQA each KV head is gathered
//                    again for each of the group's query heads, as that loop does. N = 2 splits
//                    the (sequence, query head) pairs into two halves run by the same ThreadPool.
//     shape  gqa32x8: 32 query heads, 8 KV heads (groups of 4); mha32x32: 32 and 32. Head size 128.
//     dtype  bf16 or fp16 K/V storage, or int8 / fp8 (kvattn::int8_row, kvattn::fp8_e4m3_row:
//            8-bit values and one fp32 scale per row, in the page's scale block), or fp8_layer
//            (kvattn::fp8_e4m3_layer: 8-bit values, the scales the layer's), or q4
//            (kvattn::q4_block: 4-bit values, an fp16 scale and minimum per block of 32, in the
//            page's scale block) (the quantized formats: kvattn rows only: compare them with
//            bf16's of the same run); queries and outputs fp32:
//            q, out [B][1][32][128].
//   One query per sequence (plain decode), every sequence C tokens long, pages of 16 tokens.
//   bytes_per_second = B · C · kv_heads · 2 (K and V) · row bytes per step (128 · 2 for the 16-bit
//   types, 128 + 4 for int8 and fp8: values and scale, 128 for fp8_layer, 64 + 16 for q4): the cache bytes
//   decode must read, the same count for both implementations, so their ratio is direct and each
//   compares with machine/read_bandwidth (printed at the end of the same run; the N-thread figure
//   of one is the ceiling of the other). Every benchmark runs in wall time.
//   read_bw, of_read_bw: the N-thread read bandwidth measured again right after this
//   configuration's timing loop (bench_common.hpp, read_bandwidth_now: the best of two passes
//   over the machine/read_bandwidth buffer), and this configuration's bytes per second over it.
//   On a shared machine the bandwidth left to this program drifts within one run (25-53 GiB/s
//   with 2 threads, seconds apart, seen on the 2-core machine this was written on), so of_read_bw,
//   two rates taken at the same moment, is the fraction to read; the end-of-run limit is the
//   program's summary.
//
// Configurations: C in {1K, 4K, 16K, 64K} x B in {1, 16} x N in {1, 2}, for kvattn every one
// whose K/V fits kMaxCacheBytes (4 GiB), for the baseline every one that fits kEigenMaxBytes
// (1 GiB: it materializes float copies and runs 5-20x longer, and --benchmark_min_time=0.01
// must stay a quick smoke run). Skipped:
//   all:      mha32x32 C = 64K B = 16 (16 GiB of K/V);
//   eigen:    gqa32x8 C = 64K B = 16 and mha32x32 C = 16K B = 16 (4 GiB each; kvattn runs them).
//
// The cache. One buffer of kMaxCacheBytes, on 2 MiB pages, is allocated and filled with random
// bits once (first use) and serves every pool: both storage types are 16-bit and the bits are
// chosen to be ordinary values in both (random_bits), and each (shape, type) sees it through the
// PageLayout that PagedKvCache would use (PageLayout::make, pages of 16 tokens), i.e. as a pool
// of 4 GiB / page bytes pages. Why not a PagedKvCache per (shape, type): four 4 GiB pools would
// be zeroed and filled four times (first touch of fresh memory costs seconds per GiB on a
// virtual machine), which would make the smoke run slow; the kernel reads nothing but the view
// (pool pointer, layout, CSR page table), which is built exactly as PagedKvCache::view builds it.
// A benchmark's batch is a CSR page table of B sequences of C / 16 pages each, disjoint runs of
// the pool in ascending page order (as a fresh cache hands them out): every context is a prefix
// of the same storage, so nothing is rebuilt per configuration.
// Cold data: a decode step of a real model reads every layer's cache once, far more than the
// last-level cache (260 MiB here), so a configuration smaller than twice the LLC rotates over
// several such tables (disjoint pages, as different layers are), enough to cover 2 x LLC, and
// reads cold data as machine/read_bandwidth does. The label says how many tables rotate.
//
// The baseline is checked, not trusted: after its timing loop (untimed), once per configuration,
// its output for the last step is compared with kvattn::decode's for the same table and
// queries; a difference above 1e-3 (outputs are convex combinations of values of magnitude <= 2)
// fails the benchmark with the value in the message, and the label shows the difference found.
//
// Peak memory: the 4 GiB buffer + the baseline's float copies of one head's K and V per thread
// (2 x 32 MiB at 64K) + machine/read_bandwidth's buffer at the end (1 GiB here).
// Runtime, on 2 cores: 80 s with --benchmark_min_time=0.01 (CI; a machine with a 480 MiB LLC,
// whose tables and read buffer are larger), about 30 s of it the kvattn_sinks and kvattn_alibi
// rows (--benchmark_filter=-decode/kvattn_ leaves them out); a few minutes by default.
// A filter: --benchmark_filter='gqa32x8/bf16/ctx:16384' (-machine/ leaves the limits out).
// A policy against plain, interleaved: --benchmark_filter='decode/kvattn.*/gqa32x8/bf16/ctx:16384/batch:1/threads:1'
//   --benchmark_repetitions=3 --benchmark_enable_random_interleaving=true.
// GCC 12 reports -Wmaybe-uninitialized inside Eigen's AVX-512 packet code (the baseline's
// maxCoeff and GEMVs), wherever it inlines it (_mm512_undefined_ps: a false positive, GCC bug
// 105593, as in kvattn/simd.hpp and bench/prefill.cpp); hence off for this whole file.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"  // the same, as -O1 and -O2 report it
#endif

#include "bench_common.hpp"

#include <kvattn/decode.hpp>
#if KVATTN_BENCH_KERNELS
#include <kvattn/kernels.hpp>
#endif
#include <kvattn/memory.hpp>
#include <kvattn/eigen.hpp>
#include <kvattn/paged_cache.hpp>
#include <kvattn/parallel.hpp>
#include <kvattn/policy.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <new>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace {

using kvattn::bf16;
using kvattn::BatchPageTable;
using kvattn::fp16;
using kvattn::GqaShape;
using kvattn::PagedKvView;

constexpr int kPage = 16;                                   // tokens per page
constexpr int kQHeads = 32, kHeadDim = 128;                 // both shapes
constexpr std::int64_t kMaxCacheBytes = std::int64_t{4} << 30;  // K/V of a configuration, at most; the pool buffer
constexpr std::int64_t kEigenMaxBytes = std::int64_t{1} << 30;  // K/V of the baseline's configurations
constexpr std::int64_t kContexts[] = {1024, 4096, 16384, 65536};
constexpr int kBatches[] = {1, 16};
constexpr int kThreads[] = {1, 2};
constexpr double kTolerance = 1e-3;  // baseline vs kvattn, absolute, on outputs of magnitude <= 2

template <class T> constexpr const char* type_name() { return kvattn::format_traits<T>::name.data(); }

/// Bytes of K and V one decode step must read: every token of every sequence, every KV head,
/// the rows' scales included (int8_row, fp8_e4m3_row: one fp32 per row; q4_block: 4 bytes per
/// block of 32): PageLayout::token_bytes.
template <class T> std::int64_t kv_bytes(const GqaShape& shape, std::int64_t batch, std::int64_t ctx) {
  return batch * ctx * kvattn::PageLayout::of<T>(shape, kPage).token_bytes();
}

std::string mib(std::int64_t bytes) { return std::to_string(bytes >> 20) + " MiB"; }

using kvattn::bench::shared_pool;
using kvattn::bench::with_parallel_for;

// ---- the pool ---------------------------------------------------------------------------------

/// Random storage bits, four 16-bit values per 64-bit word: s|0111 11xx|xxxx xxx with the x
/// random. As bf16 that is ±[1/8, 2) (exponent 124 to 127, random mantissa); as fp16 it is
/// s|01111|1xxx xxxx xx, ±[1.5, 2). Ordinary values in both types: one fill serves both (and
/// the 8-bit formats, whose bytes are any int8 or e4m3 code (the kernels read e4m3's NaN codes
/// as ±480: none is ever written) and whose scales, read as fp32, are ±[1/8, 2)).
std::uint64_t random_bits(std::uint64_t r) { return (r & 0x81FF81FF81FF81FFull) | 0x3E003E003E003E00ull; }

struct free_deleter {
  void operator()(std::uint16_t* p) const noexcept { std::free(p); }
};

/// The storage of every pool: kMaxCacheBytes of random 16-bit elements on 2 MiB pages (THP
/// advised, as HostMemory does), allocated and filled once, by two threads, on first use.
const std::uint16_t* pool_storage() {
  static const std::unique_ptr<std::uint16_t, free_deleter> storage = [] {
    constexpr auto bytes = static_cast<std::size_t>(kMaxCacheBytes);
    auto* data = static_cast<std::uint16_t*>(std::aligned_alloc(kvattn::kHugePage, bytes));
    if (data == nullptr) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    madvise(data, bytes, MADV_HUGEPAGE);  // a hint; failure is harmless
#endif
    constexpr std::size_t kBlock = std::size_t{1} << 20;  // words of 64 bits per work item
    const auto blocks = static_cast<std::int64_t>(bytes / 8 / kBlock);
    shared_pool(2)(blocks, [&](std::int64_t b) {
      std::uint64_t x = 0x9E3779B97F4A7C15ull * static_cast<std::uint64_t>(b + 1);  // a seed per block
      std::uint16_t* out = data + static_cast<std::size_t>(b) * kBlock * 4;
      for (std::size_t i = 0; i < kBlock; ++i) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        const std::uint64_t w = random_bits(x);
        std::memcpy(out + 4 * i, &w, sizeof w);
      }
    });
    return std::unique_ptr<std::uint16_t, free_deleter>(data);
  }();
  return storage.get();
}

/// Whether the pool could be allocated; if not, the benchmark is skipped with the reason.
bool have_pool(benchmark::State& state) {
  try {
    pool_storage();
    return true;
  } catch (const std::bad_alloc&) {
    state.SkipWithError(("cannot allocate the " + mib(kMaxCacheBytes) + " pool").c_str());
    return false;
  }
}

/// Page tables of `batch` sequences of `ctx` tokens over disjoint runs of the pool's pages (in
/// ascending order, as a fresh cache hands them out), enough tables to cover twice the
/// last-level cache as far as the pool allows, at least one.
std::vector<BatchPageTable> make_tables(std::int64_t pool_pages, std::int64_t batch, std::int64_t ctx,
                                        std::int64_t bytes_per_table) {
  const std::int64_t pages_per_seq = (ctx + kPage - 1) / kPage;
  const std::int64_t available = pool_pages / (batch * pages_per_seq);
  const auto want = static_cast<std::int64_t>(2 * kvattn::bench::llc_bytes());
  const std::int64_t count = std::max<std::int64_t>(1, std::min(available, (want + bytes_per_table - 1) / bytes_per_table));
  std::vector<BatchPageTable> tables(static_cast<std::size_t>(count));
  for (std::int64_t r = 0; r < count; ++r) {
    BatchPageTable& t = tables[static_cast<std::size_t>(r)];
    t.indptr.push_back(0);
    for (std::int64_t s = 0; s < batch; ++s) {
      const std::int64_t first = (r * batch + s) * pages_per_seq;
      for (std::int64_t i = 0; i < pages_per_seq; ++i) t.indices.push_back(static_cast<std::int32_t>(first + i));
      t.indptr.push_back(static_cast<std::int32_t>(t.indices.size()));
      t.last_page_len.push_back(static_cast<std::int32_t>(ctx - (pages_per_seq - 1) * kPage));
    }
  }
  return tables;
}

/// Queries [batch][1][q_heads][head_dim], standard normal, the same for every run.
std::vector<float> make_queries(const GqaShape& shape, std::int64_t batch) {
  std::vector<float> q(static_cast<std::size_t>(batch * shape.q_heads * shape.head_dim));
  std::mt19937 gen(12345);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& x : q) x = normal(gen);
  return q;
}

/// What every benchmark of one configuration sets up before its timing loop.
template <class T> struct Setup {
  GqaShape shape;
  std::int64_t ctx, batch;
  int threads;
  kvattn::PageLayout layout;  // one layer of `shape` in pages of kPage tokens of T, as PagedKvCache lays it out
  const T* pool;              // [pool_pages][layout.page_stride]
  std::int64_t bytes;         // K/V bytes read per step
  std::vector<BatchPageTable> tables;
  std::vector<float> q, out;

  Setup(const benchmark::State& state, const GqaShape& s)
      : shape(s), ctx(state.range(0)), batch(state.range(1)), threads(static_cast<int>(state.range(2))),
        layout(kvattn::PageLayout::of<T>(s, kPage)),
        pool(reinterpret_cast<const T*>(pool_storage())), bytes(kv_bytes<T>(s, batch, ctx)),
        tables(make_tables(kMaxCacheBytes / (layout.page_stride * static_cast<std::int64_t>(sizeof(T))), batch, ctx, bytes)),
        q(make_queries(s, batch)), out(q.size()) {}

  /// The view of table i (mod the rotation), built as PagedKvCache::view builds it.
  PagedKvView<T> view(std::size_t i) const {
    const BatchPageTable& t = tables[i % tables.size()];
    // A format with one scale per layer: 2^-8, so that its random codes read as ±[2^-17, 1.75].
    const float s = kvattn::format_traits<T>::layer_scale ? 1.0f / 256 : 1.0f;
    return PagedKvView<T>{pool, layout, t.indptr.data(), t.indices.data(), t.last_page_len.data(), t.batch(), kvattn::KvScales{s, s}};
  }
  std::string label(const std::string& what) const {
    return what + ", " + mib(bytes) + " K/V per step, " + std::to_string(tables.size()) + " table" +
           (tables.size() == 1 ? "" : "s") + " in rotation";
  }
};

// ---- kvattn ------------------------------------------------------------------------------------

/// The score policies the kvattn rows are measured with.
enum class Policy { plain, sinks, alibi };

constexpr const char* policy_name(Policy p) {
  return p == Policy::sinks ? "sinks" : p == Policy::alibi ? "alibi" : "plain";
}

/// The per-head values a policy points to: sink logits (standard normal, as learned ones are of
/// that size) or ALiBi's published slopes; none for plain.
std::vector<float> policy_values(Policy p, int q_heads) {
  if (p == Policy::alibi) return kvattn::alibi_slopes(q_heads);
  if (p == Policy::plain) return {};
  std::vector<float> v(static_cast<std::size_t>(q_heads));
  std::mt19937 gen(2024);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& x : v) x = normal(gen);
  return v;
}

/// Calls f(policy) with the policy P over `values` (q_heads of them).
template <Policy P, class F> void with_policy(const std::vector<float>& values, int q_heads, F&& f) {
  if constexpr (P == Policy::sinks)
    f(kvattn::Sinks{values.data(), q_heads});
  else if constexpr (P == Policy::alibi)
    f(kvattn::Alibi{values.data(), q_heads});
  else
    f(kvattn::Plain{});
}

/// How a kvattn row calls decode: instantiated here (kvattn/decode.hpp, for this program's flags)
/// or through the compiled kernels' dispatcher (kvattn/kernels.hpp).
enum class Way { header, compiled };

template <class T, Policy Pol, bool Int8Queries = false, bool U8Probabilities = false, Way How = Way::header>
void bm_kvattn(benchmark::State& state, GqaShape shape) {
  if (!have_pool(state)) return;
  Setup<T> s(state, shape);
  std::vector<float> lse(static_cast<std::size_t>(s.batch * shape.q_heads));
  const std::vector<float> values = policy_values(Pol, shape.q_heads);
  kvattn::DecodePlan plan;
  std::size_t step = 0;
  auto start = std::chrono::steady_clock::now();
  with_parallel_for(s.threads, [&](auto&& pf) {
    with_policy<Pol>(values, shape.q_heads, [&](const auto& policy) {
      // The step's plan, once: every table in rotation holds the same batch (B sequences of C
      // tokens), as every layer of a step does.
      kvattn::DecodeParams params;
      params.int8_queries = Int8Queries;
      params.u8_probabilities = U8Probabilities;
      plan.make(s.view(0), shape, params, pf);
      start = std::chrono::steady_clock::now();
      for (auto _ : state) {
        if constexpr (How == Way::header) {
          kvattn::decode(s.view(step++), s.q.data(), s.out.data(), lse.data(), plan, pf, policy);
        } else {
#if KVATTN_BENCH_KERNELS
          kvattn::kernels::decode(s.view(step++), s.q.data(), s.out.data(), lse.data(), plan, pf, policy);
#endif
        }
        benchmark::ClobberMemory();
      }
    });
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  kvattn::bench::report_bytes(state, s.bytes);
  kvattn::bench::report_read_fraction(state, static_cast<double>(state.iterations()) * static_cast<double>(s.bytes) / seconds, s.threads);
  std::string what = "kvattn " + std::string(kvattn::isa::native::name);
#if KVATTN_BENCH_KERNELS
  if (How == Way::compiled) what = "kvattn compiled, " + std::string(kvattn::kernels::isa());
#endif
  if (Pol != Policy::plain) what += std::string(", ") + policy_name(Pol);
  if (Int8Queries) what += ", int8 queries";
  if (U8Probabilities) what += ", u8 probabilities";
  state.SetLabel(s.label(what));
}

// ---- the Eigen baseline ------------------------------------------------------------------------

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// One thread's float copies of one head: K, V [L][head_dim] and the scores [L].
struct EigenScratch {
  RowMatrix k, v;
  Eigen::VectorXf p;
  void reserve(std::int64_t rows, int dim) {  // and touch, so that the timed loop does not fault
    k.setZero(rows, dim);
    v.setZero(rows, dim);
    p.setZero(rows);
  }
};

/// Query head h of sequence b: out [head_dim] = softmax(scale · K q) V, K and V of KV head h / group.
template <class T>
void eigen_attend(const PagedKvView<T>& kv, int b, int h, int group, const float* q, float* out, EigenScratch& s) {
  // Eigen's own 16-bit types (the same bytes as kvattn's), so that Eigen converts them its way.
  using E = std::remove_const_t<std::remove_pointer_t<decltype(as_eigen(std::declval<const T*>()))>>;
  using Block = Eigen::Matrix<E, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const int dim = kv.layout.head_dim, P = kv.layout.page_size, kv_head = h / group;
  const std::int64_t L = kv.length(b);
  s.k.resize(L, dim);
  s.v.resize(L, dim);
  const std::int32_t* pages = kv.indices + kv.indptr[b];
  for (std::int64_t t0 = 0; t0 < L; t0 += P) {  // a page holds [page_size][head_dim] per head
    const auto n = static_cast<Eigen::Index>(std::min<std::int64_t>(P, L - t0));
    const T* page = kv.page(pages[t0 / P]);
    s.k.middleRows(t0, n) = Eigen::Map<const Block>(as_eigen(page + kv.layout.key(kv_head, 0)), n, dim).template cast<float>();
    s.v.middleRows(t0, n) = Eigen::Map<const Block>(as_eigen(page + kv.layout.value(kv_head, 0)), n, dim).template cast<float>();
  }
  const Eigen::Map<const Eigen::VectorXf> qv(q, dim);
  s.p.noalias() = s.k * qv;
  s.p *= 1.0f / std::sqrt(static_cast<float>(dim));
  const float m = s.p.maxCoeff();
  s.p = (s.p.array() - m).exp().matrix();
  const float sum = s.p.sum();
  Eigen::Map<Eigen::VectorXf> o(out, dim);
  o.noalias() = s.v.transpose() * s.p;
  o /= sum;
}

/// Every (sequence, query head) of the batch; `threads` contiguous shares, one per scratch.
template <class T, class PF>
void eigen_decode(const PagedKvView<T>& kv, const GqaShape& shape, const float* q, float* out,
                  std::vector<EigenScratch>& scratch, PF&& pf) {
  const std::int64_t pairs = std::int64_t{kv.batch} * shape.q_heads;
  const auto shares = static_cast<std::int64_t>(scratch.size());
  pf(shares, [&](std::int64_t share) {
    for (std::int64_t i = share * pairs / shares; i < (share + 1) * pairs / shares; ++i) {
      const int b = static_cast<int>(i / shape.q_heads), h = static_cast<int>(i % shape.q_heads);
      eigen_attend(kv, b, h, shape.group_size(), q + i * shape.head_dim, out + i * shape.head_dim,
                   scratch[static_cast<std::size_t>(share)]);
    }
  });
}

template <class T> void bm_eigen(benchmark::State& state, GqaShape shape) {
  if (!have_pool(state)) return;
  Setup<T> s(state, shape);
  std::vector<EigenScratch> scratch(static_cast<std::size_t>(s.threads));
  for (EigenScratch& e : scratch) e.reserve(s.ctx, shape.head_dim);
  std::size_t step = 0;
  const auto start = std::chrono::steady_clock::now();
  with_parallel_for(s.threads, [&](auto&& pf) {
    for (auto _ : state) {
      eigen_decode(s.view(step++), shape, s.q.data(), s.out.data(), scratch, pf);
      benchmark::ClobberMemory();
    }
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  kvattn::bench::report_bytes(state, s.bytes);
  kvattn::bench::report_read_fraction(state, static_cast<double>(state.iterations()) * static_cast<double>(s.bytes) / seconds, s.threads);

  // Once per configuration (untimed): the last step's output against kvattn::decode's.
  static std::map<std::string, double> checked;  // configuration -> max |eigen - kvattn|
  const std::string key = std::to_string(shape.kv_heads) + type_name<T>() + "/" + std::to_string(s.ctx) + "/" +
                          std::to_string(s.batch) + "/" + std::to_string(s.threads);
  auto found = checked.find(key);
  if (found == checked.end()) {
    std::vector<float> ref(s.out.size());
    kvattn::DecodePlan plan;
    with_parallel_for(s.threads, [&](auto&& pf) {
      plan.make(s.view(step - 1), shape, kvattn::DecodeParams{}, pf);
      kvattn::decode(s.view(step - 1), s.q.data(), ref.data(), nullptr, plan, pf);
    });
    double err = 0;  // a NaN anywhere makes it NaN, which fails the check below
    for (std::size_t i = 0; i < ref.size(); ++i) {
      const double d = std::abs(static_cast<double>(ref[i]) - static_cast<double>(s.out[i]));
      if (std::isnan(d) || d > err) err = d;
    }
    found = checked.emplace(key, err).first;
  }
  char what[96];
  std::snprintf(what, sizeof what, "Eigen %d.%d.%d, max |eigen - kvattn| %.1e", EIGEN_WORLD_VERSION,
                EIGEN_MAJOR_VERSION, EIGEN_MINOR_VERSION, found->second);
  if (!(found->second <= kTolerance))
    state.SkipWithError((std::string("baseline disagrees with kvattn::decode: ") + what).c_str());
  state.SetLabel(s.label(what));
}

// ---- registration ------------------------------------------------------------------------------

/// Registers the rows of one (shape, type): plain kvattn, the baseline (16-bit types) and, with
/// `policies`, kvattn with sinks and with ALiBi, at the same configurations as plain.
template <class T> void register_family(const std::string& shape_name, const GqaShape& shape, bool policies) {
  const std::string suffix = "/" + shape_name + "/" + type_name<T>();
  std::vector<std::pair<benchmark::internal::Benchmark*, std::int64_t>> families;
  families.emplace_back(benchmark::RegisterBenchmark(("decode/kvattn" + suffix).c_str(), bm_kvattn<T, Policy::plain>, shape),
                        kMaxCacheBytes);
#if KVATTN_BENCH_KERNELS
  // The same kernels through the dispatcher, beside the rows instantiated here.
  if constexpr (kvattn::kernels::decode_compiled<T, kvattn::Plain>)
    families.emplace_back(benchmark::RegisterBenchmark(("decode/kvattn_compiled" + suffix).c_str(),
                                                       bm_kvattn<T, Policy::plain, false, false, Way::compiled>, shape),
                          kMaxCacheBytes);
#endif
  if (policies) {
    families.emplace_back(
        benchmark::RegisterBenchmark(("decode/kvattn_sinks" + suffix).c_str(), bm_kvattn<T, Policy::sinks>, shape), kMaxCacheBytes);
    families.emplace_back(
        benchmark::RegisterBenchmark(("decode/kvattn_alibi" + suffix).c_str(), bm_kvattn<T, Policy::alibi>, shape), kMaxCacheBytes);
  }
  if constexpr (kvattn::is_storage_type_v<T>)
    families.emplace_back(benchmark::RegisterBenchmark(("decode/eigen" + suffix).c_str(), bm_eigen<T>, shape), kEigenMaxBytes);
  if constexpr (kvattn::is_int8_format_v<T>)
    families.emplace_back(
        benchmark::RegisterBenchmark(("decode/kvattn_i8q" + suffix).c_str(), bm_kvattn<T, Policy::plain, true>, shape), kMaxCacheBytes);
  if constexpr (kvattn::is_int8_format_v<T>)
    families.emplace_back(benchmark::RegisterBenchmark(("decode/kvattn_i8qp" + suffix).c_str(),
                                                       bm_kvattn<T, Policy::plain, true, true>, shape),
                          kMaxCacheBytes);
  for (auto [b, limit] : families) {
    b->ArgNames({"ctx", "batch", "threads"})->UseRealTime()->Unit(benchmark::kMillisecond);
    for (int batch : kBatches)
      for (std::int64_t ctx : kContexts)
        for (int threads : kThreads)
          if (kv_bytes<T>(shape, batch, ctx) <= limit) b->Args({ctx, batch, threads});
  }
}

// In this order (grouped by pool, which is built once per group); the machine limits run last.
const bool registered = [] {
  const GqaShape gqa = GqaShape::gqa(kQHeads, 8, kHeadDim), mha = GqaShape::mha(kQHeads, kHeadDim);
  register_family<bf16>("gqa32x8", gqa, true);
  register_family<fp16>("gqa32x8", gqa, true);
  register_family<bf16>("mha32x32", mha, false);
  register_family<fp16>("mha32x32", mha, false);
  // int8 with a scale per row (int8_row): its rows beside bf16's of the same run are the gain
  // of the 8-bit cache; no baseline of its own.
  register_family<kvattn::int8_row>("gqa32x8", gqa, false);
  register_family<kvattn::int8_row>("mha32x32", mha, false);
  register_family<kvattn::fp8_e4m3_row>("gqa32x8", gqa, false);  // fp8 e4m3, a scale per row, likewise
  register_family<kvattn::fp8_e4m3_layer>("gqa32x8", gqa, false);  // fp8 e4m3, the layer's scales, likewise
  register_family<kvattn::q4_block>("gqa32x8", gqa, false);  // 4-bit blocks of 32, a scale and minimum each, likewise
  kvattn::bench::register_read_with_fma();  // the reads a kernel keeps for the core time it spends per byte
  return true;
}();

}  // namespace

KVATTN_BENCHMARK_MAIN()
