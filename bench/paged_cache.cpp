// bench/paged_cache.cpp — PagedKvCache: how fast tokens go in (append) and what a fork costs.
//
// Every benchmark runs in wall time (UseRealTime or manual time), like the machine limits that
// KVATTN_BENCHMARK_MAIN() prints after them, so bytes/s here and read_bandwidth there compare.
// Storage is bf16 throughout; written K/V come in as fp32, so the conversion is part of the cost.
//
//   paged_cache/append_slots/n:N/page:P/ctx:C       bookkeeping only: append(seq, n) returns
//       slots and touches no page storage. One iteration is one sequence's life: add_sequence,
//       C/N appends of N tokens, remove (the reset is part of the measured cost, amortized over
//       C tokens, as it is in an engine). items_per_second = tokens/s; pages/s = pages taken.
//       n=1 is decode, n=512 a prefill chunk; page=1 against page=16 shows the per-page cost,
//       ctx=32768 against 4096 whether a token costs more in a long sequence. The pool is one
//       layer of one 8-wide KV head (its bytes do not matter to append).
//   paged_cache/append_write/<model>/n:N/ctx:C      append(seq, n), then write every layer's K/V
//       (GQA) or latent + rotary key (MLA) of those n tokens, page 16; one iteration per life
//       of C tokens as above. items_per_second = tokens/s; bytes_per_second = bf16 bytes
//       stored (the fp32 input read is twice that). C makes one life write about 512 MiB, more
//       than this machine's last-level cache, so the stores go to memory as in a full cache.
//       The input rows are the same for every layer and stay in cache, as a projection's
//       fresh output would.
//   paged_cache/cow_first_append/llama-3-8b/ctx:C   a forked child's first token after the
//       parent's partly filled last page (the parent holds C - 1 tokens): append(child, 1)
//       copies that page in every layer, 32 x 64 KiB = 2 MiB. Manual time around that append
//       only; the fork and the clean-up are outside. The source is the parent's page (hot
//       after the first copy, as when many children of one prompt start); the destinations
//       rotate over spare pages worth twice the last-level cache (64 MiB to 1 GiB), so they are
//       cold, as free pages of a full cache are. bytes_per_second = bytes copied (each is read
//       once and written once: the memory traffic is at least twice that).
//   paged_cache/fork/<pool>/ctx:C                   fork() of a parent of C - 1 tokens (C/16
//       pages of 16). Children are removed 256 at a time with the timer paused (one pause per
//       256 forks). pages = the parent's pages; time_per_page = time / pages ("530ps" is
//       0.53 ns); bytes_shared = bytes the child shares instead of copying. fork reads the page
//       table and never the pool: "tiny" (1 layer, 1 KV head x 8) reaches 64K tokens in a few
//       MiB, "llama-3-8b" (2 MiB per page) repeats 1K and 4K to show that bytes do not count.
//
// Pools are kept between trials. Google Benchmark calls a benchmark's function once per trial
// while it sizes the iteration count (up to ~6 times), and allocating and zeroing a pool of
// 0.5-1 GiB costs more than a trial, so kept_pool() keeps one pool, keyed by its configuration,
// until a benchmark asks for another; benchmarks that can share a pool do (the Llama-3-8B
// append, copy-on-write and fork benchmarks use one). Every benchmark leaves its pool as it
// found it (apart from the one sequence it asked for). The fork/tiny benchmarks run last, so
// the pool still held while the machine limits allocate their own 1 GiB is a few MiB. Peak:
// one pool, the Llama-3-8B one: 512 MiB + the copy-on-write spares (1032 MiB here, 1.5 GiB at
// most). A filter that picks only a big pool's benchmarks and machine/ holds both.
#include "bench_common.hpp"

#include <kvattn/paged_cache.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace {

using kvattn::bf16;
using kvattn::CacheConfig;
using kvattn::Model;
using kvattn::SeqId;
using kvattn::Slot;
using Cache = kvattn::PagedKvCache<bf16>;

constexpr int kPage = 16;               // page size of every benchmark but append_slots/page:1
constexpr int kMaxCtx = 4096;           // longest parent / life in the Llama-3-8B pool
constexpr std::size_t kChildrenPerPause = 256;  // fork: children removed in one paused clean-up

/// One layer of one 8-wide KV head: a pool whose bytes do not matter (bookkeeping only).
const Model kTiny{"tiny", 1, kvattn::GqaShape::mqa(1, 8)};

std::int64_t page_bytes(const Model& model, int page) {  // one page, all layers, padding included
  return model.layers * kvattn::PageLayout::make(model.attention, page, sizeof(bf16)).page_stride *
         static_cast<std::int64_t>(sizeof(bf16));
}

/// cow_first_append: pages its destinations rotate over, twice the last-level cache.
std::int64_t cow_spare_pages(const Model& model) {
  const auto llc = static_cast<std::int64_t>(kvattn::bench::llc_bytes());
  const std::int64_t bytes = std::clamp<std::int64_t>(2 * llc, std::int64_t{64} << 20, std::int64_t{1} << 30);
  return std::max<std::int64_t>(1, bytes / page_bytes(model, kPage));
}

/// The pool of the Llama-3-8B benchmarks: a parent or a life of kMaxCtx tokens, plus the spares.
std::int64_t llama_pool_pages(const Model& model) { return kMaxCtx / kPage + cow_spare_pages(model); }

/// A pool kept from one trial to the next, and the sequence that fork benchmarks fork.
struct KeptPool {
  std::string key;
  std::unique_ptr<Cache> cache;
  SeqId parent = -1;  // -1: none
};

/// The pool of `model` with pages of `page` tokens, `pages` of them, holding one sequence of
/// `parent_length` tokens (0: no sequence) and nothing else. Frees the pool held before, if it
/// was another, before allocating this one.
KeptPool& kept_pool(const Model& model, int page, std::int64_t pages, std::int64_t parent_length) {
  static KeptPool held;
  std::string key(model.name);
  for (std::int64_t field : {std::int64_t{model.layers}, std::int64_t{page}, pages}) {
    key += ' ';
    key += std::to_string(field);
  }
  if (held.key != key) {
    held = KeptPool{};  // the old pool goes first
    held.cache = std::make_unique<Cache>(CacheConfig::for_model(model, page, pages));
    held.key = std::move(key);
  }
  Cache& cache = *held.cache;
  if (held.parent >= 0 && cache.length(held.parent) != parent_length) {
    cache.remove(held.parent);
    held.parent = -1;
  }
  if (held.parent < 0 && parent_length > 0) {
    held.parent = cache.add_sequence();
    cache.append(held.parent, parent_length);
  }
  return held;
}

std::string mib(std::int64_t bytes) { return std::to_string(bytes >> 20) + " MiB"; }

/// fp32 inputs of ordinary values (no NaN, no subnormal).
std::vector<float> input(std::int64_t elements) {
  std::vector<float> v(static_cast<std::size_t>(elements));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = std::sin(0.01f * static_cast<float>(i % 4096)) * 3.0f;
  return v;
}

// ---- append: bookkeeping only ---------------------------------------------------------------

void bm_append_slots(benchmark::State& state) {
  const std::int64_t n = state.range(0), page = state.range(1), ctx = state.range(2);
  const std::int64_t pages = (ctx + page - 1) / page;
  Cache& cache = *kept_pool(kTiny, static_cast<int>(page), pages, 0).cache;
  for (auto _ : state) {
    const SeqId seq = cache.add_sequence();
    for (std::int64_t t = 0; t < ctx; t += n) {
      std::vector<Slot> slots = cache.append(seq, std::min(n, ctx - t));
      benchmark::DoNotOptimize(slots.data());
    }
    cache.remove(seq);
  }
  state.SetItemsProcessed(state.iterations() * ctx);
  state.counters["pages/s"] = benchmark::Counter(static_cast<double>(state.iterations() * pages),
                                                 benchmark::Counter::kIsRate);
  state.SetLabel("bookkeeping only, " + std::to_string(pages) + " pages per life");
}

// ---- append + write every layer -------------------------------------------------------------

void bm_append_write(benchmark::State& state, const Model& model, std::int64_t pool_pages) {
  const std::int64_t n = state.range(0), ctx = state.range(1);
  Cache& cache = *kept_pool(model, kPage, pool_pages, 0).cache;
  const kvattn::PageLayout& layout = cache.layout();
  const int layers = model.layers;
  const bool mla = model.is_mla();
  // GQA: k in a, v in b, each [n][kv_heads][head_dim]. MLA: latent [n][latent_dim] in a, rope [n][rope_dim] in b.
  const std::int64_t kv_row = std::int64_t{layout.kv_heads} * layout.head_dim;
  const std::vector<float> a = input(n * (mla ? layout.latent_dim : kv_row));
  const std::vector<float> b = input(n * (mla ? layout.rope_dim : kv_row));
  for (auto _ : state) {
    const SeqId seq = cache.add_sequence();
    for (std::int64_t t = 0; t < ctx; t += n) {
      const std::int64_t count = std::min(n, ctx - t);
      std::vector<Slot> slots = cache.append(seq, count);
      benchmark::DoNotOptimize(slots.data());
      for (int l = 0; l < layers; ++l) {
        if (mla)
          cache.write_latent(seq, l, t, count, a.data(), b.data());
        else
          cache.write(seq, l, t, count, a.data(), b.data());
      }
    }
    cache.remove(seq);
    benchmark::ClobberMemory();
  }
  const std::int64_t bytes = ctx * layout.token_elements() * layers * static_cast<std::int64_t>(sizeof(bf16));
  state.SetItemsProcessed(state.iterations() * ctx);
  kvattn::bench::report_bytes(state, bytes);
  state.SetLabel(std::string(model.name) + ", " + std::to_string(layers) + " layers, bf16 from fp32, " +
                 mib(bytes) + " per life");
}

// ---- copy-on-write: a child's first append into the shared last page ------------------------

void bm_cow_first_append(benchmark::State& state, const Model& model) {
  using clock = std::chrono::steady_clock;
  const std::int64_t ctx = state.range(0);
  const std::int64_t spare = cow_spare_pages(model), one_page = page_bytes(model, kPage);
  // The parent's last page holds 15 of 16 tokens: a child's next token copies it.
  KeptPool& kept = kept_pool(model, kPage, llama_pool_pages(model), ctx - 1);
  Cache& cache = *kept.cache;
  std::vector<SeqId> children;
  children.reserve(static_cast<std::size_t>(spare));
  for (auto _ : state) {
    if (static_cast<std::int64_t>(children.size()) == spare) {  // every spare page holds a copy
      for (SeqId c : children) cache.remove(c);
      children.clear();
    }
    const SeqId child = cache.fork(kept.parent);
    children.push_back(child);
    const auto start = clock::now();
    std::vector<Slot> slots = cache.append(child, 1);
    const auto stop = clock::now();
    benchmark::DoNotOptimize(slots.data());
    state.SetIterationTime(std::chrono::duration<double>(stop - start).count());
  }
  for (SeqId c : children) cache.remove(c);
  kvattn::bench::report_bytes(state, one_page);
  state.counters["pages"] = static_cast<double>(cache.pages(kept.parent).size());
  state.SetLabel(std::string(model.name) + ", copies " + std::to_string(model.layers) + " x " +
                 std::to_string(one_page / model.layers >> 10) + " KiB, destinations over " + mib(spare * one_page));
}

// ---- fork -----------------------------------------------------------------------------------

void bm_fork(benchmark::State& state, const Model& model, std::int64_t pool_pages) {
  const std::int64_t ctx = state.range(0);
  KeptPool& kept = kept_pool(model, kPage, pool_pages, ctx - 1);
  Cache& cache = *kept.cache;
  std::vector<SeqId> children;
  children.reserve(kChildrenPerPause);
  for (auto _ : state) {
    if (children.size() == kChildrenPerPause) {
      state.PauseTiming();
      for (SeqId c : children) cache.remove(c);
      children.clear();
      state.ResumeTiming();
    }
    children.push_back(cache.fork(kept.parent));
  }
  for (SeqId c : children) cache.remove(c);
  const auto pages = static_cast<double>(cache.pages(kept.parent).size());
  state.counters["pages"] = pages;
  state.counters["time_per_page"] =
      benchmark::Counter(pages, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
  state.counters["bytes_shared"] = benchmark::Counter(pages * static_cast<double>(page_bytes(model, kPage)),
                                                      benchmark::Counter::kDefaults, benchmark::Counter::kIs1024);
  state.SetLabel(std::string(model.name) + ", " + std::to_string(model.layers) + " layer" +
                 (model.layers == 1 ? "" : "s"));
}

// Registered in this order, which is the order they run in (see "Pools are kept" above).
const bool registered = [] {
  const Model& llama = kvattn::presets::llama3_8b.model;
  const Model& deepseek = kvattn::presets::deepseek_v2.model;
  const std::int64_t llama_pages = llama_pool_pages(llama);

  auto* slots = benchmark::RegisterBenchmark("paged_cache/append_slots", bm_append_slots);
  slots->ArgNames({"n", "page", "ctx"})->UseRealTime()->Unit(benchmark::kMicrosecond);
  for (std::int64_t page : {1, 16})
    for (std::int64_t n : {1, 512}) slots->Args({n, page, 4096});
  for (std::int64_t page : {1, 16}) slots->Args({1, page, 32768});

  // About 512 MiB per life: 128 KiB per token for Llama-3-8B, 67.5 KiB for DeepSeek-V2.
  auto* write_mla = benchmark::RegisterBenchmark("paged_cache/append_write/deepseek-v2", bm_append_write,
                                                 deepseek, std::int64_t{2 * kMaxCtx / kPage});
  write_mla->ArgNames({"n", "ctx"})->UseRealTime()->Unit(benchmark::kMillisecond);
  for (std::int64_t n : {1, 512}) write_mla->Args({n, 2 * kMaxCtx});
  auto* write_gqa =
      benchmark::RegisterBenchmark("paged_cache/append_write/llama-3-8b", bm_append_write, llama, llama_pages);
  write_gqa->ArgNames({"n", "ctx"})->UseRealTime()->Unit(benchmark::kMillisecond);
  for (std::int64_t n : {1, 512}) write_gqa->Args({n, kMaxCtx});

  auto* cow = benchmark::RegisterBenchmark("paged_cache/cow_first_append/llama-3-8b", bm_cow_first_append, llama);
  cow->ArgName("ctx")->UseManualTime()->Unit(benchmark::kMicrosecond);
  for (std::int64_t ctx : {256, 1024, kMaxCtx}) cow->Arg(ctx);

  auto* fork_llama = benchmark::RegisterBenchmark("paged_cache/fork/llama-3-8b", bm_fork, llama, llama_pages);
  fork_llama->ArgName("ctx")->UseRealTime()->Unit(benchmark::kNanosecond);
  for (std::int64_t ctx : {1024, kMaxCtx}) fork_llama->Arg(ctx);
  constexpr int kTinyMaxCtx = 65536;
  auto* fork_tiny = benchmark::RegisterBenchmark("paged_cache/fork/tiny", bm_fork, kTiny, kTinyMaxCtx / kPage);
  fork_tiny->ArgName("ctx")->UseRealTime()->Unit(benchmark::kNanosecond);
  for (std::int64_t ctx : {1024, 4096, 16384, kTinyMaxCtx}) fork_tiny->Arg(ctx);
  return true;
}();

}  // namespace

KVATTN_BENCHMARK_MAIN()
