// bench/bench_common.hpp — shared by every kvattn benchmark program.
//
// kvattn's figures are judged against this machine's limits measured in the same run
// (DESIGN.md, "How performance is judged"): absolute times on a shared machine are noise, a
// fraction of the limit is not. KVATTN_BENCHMARK_MAIN() therefore adds, to every program:
//
//   machine/read_bandwidth/real_time/threads:N   bytes_per_second
//     Streaming reads of a buffer far larger than the last-level cache (max(1 GiB, 4 x LLC),
//     at most a quarter of physical memory); each thread reads its own 1/N slice with vector
//     loads and adds. The ceiling of a memory-bound kernel such as decode attention, which reads
//     the whole KV cache once per step.
//   machine/fma_peak_f32/real_time/threads:N     FLOP/s
//     Independent fp32 fused multiply-add chains (enough to cover FMA latency x throughput),
//     in the widest vectors this translation unit targets (isa::native). The ceiling of a
//     compute-bound kernel such as prefill or MLA's folded decode. One FMA = 2 FLOP.
//
// bench_decode also adds (register_read_with_fma):
//
//   machine/read_with_fma/flop_per_byte:F/real_time/threads:N   bytes_per_second, FLOP/s
//     machine/read_bandwidth's streaming reads, each line also prefetched 16 KiB ahead as the
//     decode kernel does, with F FLOP of fp32 FMAs per byte read spread evenly over the reads:
//     independent chains on registers, using nothing that was read. How much of the read
//     bandwidth a stream keeps when each byte also costs core time: the ceiling of a kernel
//     that spends as long per byte. F = 0 is the plain stream (with the prefetches).
//
// N is 1, 2 and, where there are more cores, all of them. Both use wall time (UseRealTime), and
// Google Benchmark sums the threads' work, so the figure for N threads is the aggregate rate.
// Google Benchmark prints bytes_per_second in binary units (G/s = GiB/s) and FLOP/s in decimal
// ones (G/s = 1e9 FLOP/s); the JSON output (--benchmark_format=json) holds exact numbers.
// They run after the program's own benchmarks. A --benchmark_filter that does not match
// "machine/" (or --benchmark_filter=-machine/) leaves them out and allocates no buffer.
#pragma once

#include <benchmark/benchmark.h>
#include <kvattn/config.hpp>
#include <kvattn/parallel.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
#endif
#if KVATTN_HAS_AVX512 || KVATTN_HAS_AVX2
#include <immintrin.h>
#elif KVATTN_HAS_NEON
#include <arm_neon.h>
#endif

namespace kvattn::bench {
KVATTN_BEGIN_TARGET_NAMESPACE

/// Bytes of the largest cache this machine reports (Linux: sysconf, then sysfs), or 32 MiB
/// when it reports none.
inline std::size_t llc_bytes() {
#if defined(_SC_LEVEL3_CACHE_SIZE)
  if (const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE); l3 > 0) return static_cast<std::size_t>(l3);
#endif
  std::size_t best = 0;  // sysfs lists every level as "48K", "2048K", "260M"...
  for (int index = 0; index < 8; ++index) {
    std::ifstream in("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/size");
    std::size_t size = 0;
    char unit = 0;
    if (!(in >> size)) continue;
    in >> unit;
    size <<= unit == 'K' ? 10 : unit == 'M' ? 20 : unit == 'G' ? 30 : 0;
    best = std::max(best, size);
  }
  return best > 0 ? best : std::size_t{32} << 20;
}

/// Bytes of the bandwidth buffer: max(1 GiB, 4 x llc_bytes()), at most a quarter of physical
/// memory where that is known, rounded down to 2 MiB (one huge page).
inline std::size_t read_buffer_bytes() {
  constexpr std::size_t huge_page = std::size_t{2} << 20;
  std::size_t bytes = std::max(std::size_t{1} << 30, 4 * llc_bytes());
#if defined(_SC_PHYS_PAGES) && defined(_SC_PAGESIZE)
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0)
    bytes = std::min(bytes, static_cast<std::size_t>(pages) * static_cast<std::size_t>(page) / 4);
#endif
  return std::max(huge_page, bytes / huge_page * huge_page);
}

/// Sets bytes_per_second from the bytes *this thread* reads or writes per iteration. Call once,
/// after the benchmark loop; with Threads(N), each thread reports its own share.
inline void report_bytes(benchmark::State& state, std::int64_t bytes_per_iteration) {
  state.SetBytesProcessed(state.iterations() * bytes_per_iteration);
}

/// Sets the "FLOP/s" counter from the floating-point operations *this thread* does per
/// iteration (a multiply-add counts 2). Call once, after the benchmark loop.
inline void report_flops(benchmark::State& state, double flops_per_iteration) {
  const double flops = static_cast<double>(state.iterations()) * flops_per_iteration;
  state.counters["FLOP/s"] = benchmark::Counter(flops, benchmark::Counter::kIsRate);
}

/// The pool of N threads shared by a program's benchmarks (its workers sleep between calls).
inline kvattn::ThreadPool& shared_pool(int threads) {
  static std::unique_ptr<kvattn::ThreadPool> pool;
  if (!pool || pool->threads() != threads) {
    pool.reset();
    pool = std::make_unique<kvattn::ThreadPool>(threads);
  }
  return *pool;
}

/// Runs f(pf) with the parallel-for of `threads`: SerialFor for 1, the shared pool otherwise.
template <class F> void with_parallel_for(int threads, F&& f) {
  if (threads == 1)
    f(kvattn::SerialFor{});
  else
    f(shared_pool(threads));
}

namespace detail {

// The vector operations the two limits need, for the widest set this translation unit targets.
// f32::fma(acc, a, b) = acc + a * b, with the accumulator as the addend, which every ISA's FMA
// overwrites in place (vfmadd231ps, fmla). u64 adds whole vectors of 64-bit integers.
#if KVATTN_HAS_AVX512
struct f32 {
  using V = __m512;
  static constexpr int lanes = 16, chains = 16;  // 2 FMA ports x 4 cycles latency = 8 needed
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V fma(V acc, V a, V b) { return _mm512_fmadd_ps(a, b, acc); }
  static V add(V x, V y) { return _mm512_add_ps(x, y); }
};
struct u64 {
  using V = __m512i;
  static V zero() { return _mm512_setzero_si512(); }
  static V load(const std::byte* p) { return _mm512_load_si512(static_cast<const void*>(p)); }
  static V add(V x, V y) { return _mm512_add_epi64(x, y); }
};
#elif KVATTN_HAS_AVX2
struct f32 {
  using V = __m256;
  static constexpr int lanes = 8, chains = 12;  // 16 ymm registers: 12 chains + 2 constants
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V fma(V acc, V a, V b) { return _mm256_fmadd_ps(a, b, acc); }
  static V add(V x, V y) { return _mm256_add_ps(x, y); }
};
struct u64 {
  using V = __m256i;
  static V zero() { return _mm256_setzero_si256(); }
  static V load(const std::byte* p) {
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(p));
  }
  static V add(V x, V y) { return _mm256_add_epi64(x, y); }
};
#elif KVATTN_HAS_NEON
struct f32 {
  using V = float32x4_t;
  static constexpr int lanes = 4, chains = 16;  // up to 4 FMA pipes x 4 cycles latency
  static V set1(float x) { return vdupq_n_f32(x); }
  static V fma(V acc, V a, V b) { return vfmaq_f32(acc, a, b); }
  static V add(V x, V y) { return vaddq_f32(x, y); }
};
struct u64 {
  using V = uint64x2_t;
  static V zero() { return vdupq_n_u64(0); }
  static V load(const std::byte* p) {
    return vld1q_u64(reinterpret_cast<const std::uint64_t*>(p));
  }
  static V add(V x, V y) { return vaddq_u64(x, y); }
};
#else
struct f32 {
  using V = float;
  static constexpr int lanes = 1, chains = 12;
  static V set1(float x) { return x; }
#if defined(FP_FAST_FMAF)
  static V fma(V acc, V a, V b) { return std::fma(a, b, acc); }
#else
  // No FMA instruction: std::fma would be a library call, and acc + a * b would let the compiler
  // hoist a * b out of the loop. acc * a + b keeps both operations on the chain.
  static V fma(V acc, V a, V b) { return acc * a + b; }
#endif
  static V add(V x, V y) { return x + y; }
};
struct u64 {
  using V = std::uint64_t;
  static V zero() { return 0; }
  static V load(const std::byte* p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  static V add(V x, V y) { return x + y; }
};
#endif

/// x, read back through a volatile: a value the compiler cannot know, so that nothing computed
/// from it is folded. (benchmark::DoNotOptimize on a float variable does not do this with GCC 12:
/// its "+m,r" constraint lets GCC drop the variable's store and read an uninitialized stack
/// slot, GCC bug 105519; the FMA limits then ran on whatever that slot held, subnormals included,
/// which are a hundred times slower.)
inline float opaque(float x) noexcept {
  volatile float v = x;
  return v;
}

/// The first lane of v, so that a result can be handed to benchmark::DoNotOptimize as a scalar.
template <class Scalar, class V>
Scalar first_lane(const V& v) {
  Scalar s;
  std::memcpy(&s, &v, sizeof s);
  return s;
}

/// Sum of the 64-bit words in [begin, end): one pass of streaming reads. Both ends are aligned
/// to, and the length is a multiple of, 4 * sizeof(u64::V) (at most 256 bytes).
inline std::uint64_t read_pass(const std::byte* begin, const std::byte* end) noexcept {
  constexpr std::size_t w = sizeof(u64::V);
  u64::V a0 = u64::zero(), a1 = a0, a2 = a0, a3 = a0;
  for (const std::byte* p = begin; p != end; p += 4 * w) {
    a0 = u64::add(a0, u64::load(p));
    a1 = u64::add(a1, u64::load(p + w));
    a2 = u64::add(a2, u64::load(p + 2 * w));
    a3 = u64::add(a3, u64::load(p + 3 * w));
  }
  const u64::V sum = u64::add(u64::add(a0, a1), u64::add(a2, a3));
  return first_lane<std::uint64_t>(sum);
}

/// Chains of machine/read_with_fma's FMAs: enough to cover the FMA latency on every FMA port,
/// few enough to leave the loads registers (AVX2 has 16). With these, a round of FMAs on every
/// chain is 2 · lanes · chains FLOP, which divides 1024 · 2 for every ISA here: a whole number
/// of rounds per KiB for every even FLOP per byte.
constexpr int kStreamChains = f32::lanes == 16 || f32::lanes == 4 ? 16 : 8;
/// How far ahead of its reads machine/read_with_fma prefetches (into L2), in bytes.
constexpr std::size_t kStreamPrefetch = std::size_t{16} << 10;

/// Runs `steps` rounds of acc[i] = acc[i] + a * b on every chain; independent chains let the
/// FMA units start one every cycle on each port.
template <std::size_t... I>
KVATTN_ALWAYS_INLINE void fma_rounds(f32::V (&acc)[sizeof...(I)], f32::V a, f32::V b, int steps,
                                     std::index_sequence<I...>) noexcept {
  for (int s = 0; s < steps; ++s) ((acc[I] = f32::fma(acc[I], a, b)), ...);
}

/// read_pass with `rounds_per_kib` rounds of FMAs on every chain of acc per KiB read, spread
/// evenly over the KiB (after each group of four vector loads, the rounds due by then), and a
/// prefetch of every line kStreamPrefetch bytes ahead of its read (none past `end`).
inline std::uint64_t read_pass_with_fma(const std::byte* begin, const std::byte* end, int rounds_per_kib,
                                        f32::V (&acc)[kStreamChains], f32::V a, f32::V b) noexcept {
  constexpr std::size_t w = sizeof(u64::V), group = 4 * w;
  static_assert(1024 % group == 0, "groups of loads tile a KiB");
  u64::V a0 = u64::zero(), a1 = a0, a2 = a0, a3 = a0;
  std::size_t in_kib = 0;  // bytes of the current KiB read so far
  int done = 0;            // rounds done in the current KiB
  for (const std::byte* p = begin; p != end; p += group) {
    if (static_cast<std::size_t>(end - p) > kStreamPrefetch)
      for (std::size_t line = 0; line < group; line += 64) KVATTN_PREFETCH_L2(p + kStreamPrefetch + line);
    a0 = u64::add(a0, u64::load(p));
    a1 = u64::add(a1, u64::load(p + w));
    a2 = u64::add(a2, u64::load(p + 2 * w));
    a3 = u64::add(a3, u64::load(p + 3 * w));
    in_kib += group;
    const int due = static_cast<int>(static_cast<std::size_t>(rounds_per_kib) * in_kib / 1024);
    for (; done < due; ++done) fma_rounds(acc, a, b, 1, std::make_index_sequence<kStreamChains>{});
    if (in_kib == 1024) {
      in_kib = 0;
      done = 0;
    }
  }
  const u64::V sum = u64::add(u64::add(a0, a1), u64::add(a2, a3));
  return first_lane<std::uint64_t>(sum);
}

struct aligned_free {
  void operator()(std::byte* p) const noexcept {
    ::operator delete(p, std::align_val_t{std::size_t{2} << 20});
  }
};

/// The bandwidth buffer, [read_buffer_bytes()] bytes aligned to 2 MiB: allocated and written
/// once, on first use (not at registration, so a filtered run does not pay for it), kept for the
/// rest of the program. Throws std::bad_alloc.
inline const std::byte* read_buffer() {
  static const std::unique_ptr<std::byte, aligned_free> buffer = [] {
    const std::size_t bytes = read_buffer_bytes();
    std::unique_ptr<std::byte, aligned_free> p(
        static_cast<std::byte*>(::operator new(bytes, std::align_val_t{std::size_t{2} << 20})));
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    madvise(p.get(), bytes, MADV_HUGEPAGE);  // fewer TLB misses; a hint, failure is harmless
#endif
    std::memset(p.get(), 0x5a, bytes);  // real pages, not the shared zero page
    return p;
  }();
  return buffer.get();
}

/// This thread's slice of the bandwidth buffer: 1/threads of it, rounded down to a multiple of
/// `granule` bytes. begin is null, and the benchmark skipped with the reason, if the buffer
/// cannot be had (the benchmark loop then runs no iteration).
struct ThreadSlice {
  const std::byte* begin;
  std::size_t bytes;
};
inline ThreadSlice thread_slice(benchmark::State& state, std::size_t granule) {
  const std::size_t total = read_buffer_bytes();
  const std::byte* buffer = nullptr;
  try {
    buffer = read_buffer();
  } catch (const std::bad_alloc&) {
    state.SkipWithError(("cannot allocate " + std::to_string(total >> 20) + " MiB").c_str());
  }
  const std::size_t bytes = total / static_cast<std::size_t>(state.threads()) / granule * granule;
  return {buffer ? buffer + static_cast<std::size_t>(state.thread_index()) * bytes : nullptr, bytes};
}

/// machine/read_bandwidth: each thread sums its own slice of the buffer once per iteration.
inline void bm_read_bandwidth(benchmark::State& state) {
  const ThreadSlice s = thread_slice(state, 256);
  const std::byte* begin = s.begin;
  const std::size_t slice = s.bytes, total = read_buffer_bytes();
  for (auto _ : state) {  // runs no iteration after SkipWithError
    std::uint64_t sum = read_pass(begin, begin + slice);
    benchmark::DoNotOptimize(sum);
    benchmark::ClobberMemory();  // the buffer must be read again on the next iteration
  }
  report_bytes(state, static_cast<std::int64_t>(slice));
  state.SetLabel(std::string(isa::native::name) + ", " + std::to_string(total >> 20) +
                 " MiB, LLC " + std::to_string(llc_bytes() >> 20) + " MiB");
}

/// machine/fma_peak_f32: f32::chains independent FMA chains, 256 rounds per iteration.
inline void bm_fma_peak_f32(benchmark::State& state) {
  constexpr int chains = f32::chains, rounds = 256;
  // acc stays within [2^-12, 2]: no overflow, no subnormals. a and b are hidden from the
  // compiler, so that it has nothing to fold.
  const f32::V a = f32::set1(opaque(0x1p-12f)), b = f32::set1(opaque(0x1p-12f));
  f32::V acc[chains];
  for (int i = 0; i < chains; ++i) acc[i] = f32::set1(1.0f + static_cast<float>(i) / 64);
  for (auto _ : state) fma_rounds(acc, a, b, rounds, std::make_index_sequence<chains>{});
  f32::V sum = acc[0];
  for (int i = 1; i < chains; ++i) sum = f32::add(sum, acc[i]);
  float result = first_lane<float>(sum);
  benchmark::DoNotOptimize(result);
  report_flops(state, 2.0 * f32::lanes * chains * rounds);
  state.SetLabel(std::string(isa::native::name) + ", " + std::to_string(chains) + " chains");
}

/// machine/read_with_fma: bm_read_bandwidth's passes, each byte read with flop_per_byte FLOP
/// of FMAs (an even number: whole rounds per KiB).
inline void bm_read_with_fma(benchmark::State& state) {
  const int flop_per_byte = static_cast<int>(state.range(0));
  const int rounds_per_kib = flop_per_byte * 1024 / (2 * f32::lanes * kStreamChains);
  const ThreadSlice s = thread_slice(state, 1024);  // whole KiB: whole rounds
  const std::byte* begin = s.begin;
  const std::size_t slice = s.bytes;
  // As in bm_fma_peak_f32: acc stays within [2^-12, 2], a and b hidden from the compiler.
  const f32::V a = f32::set1(opaque(0x1p-12f)), b = f32::set1(opaque(0x1p-12f));
  f32::V acc[kStreamChains];
  for (int i = 0; i < kStreamChains; ++i) acc[i] = f32::set1(1.0f + static_cast<float>(i) / 64);
  for (auto _ : state) {
    std::uint64_t sum = read_pass_with_fma(begin, begin + slice, rounds_per_kib, acc, a, b);
    benchmark::DoNotOptimize(sum);
    benchmark::ClobberMemory();
  }
  f32::V fsum = acc[0];
  for (int i = 1; i < kStreamChains; ++i) fsum = f32::add(fsum, acc[i]);
  float result = first_lane<float>(fsum);
  benchmark::DoNotOptimize(result);
  report_bytes(state, static_cast<std::int64_t>(slice));
  report_flops(state, static_cast<double>(rounds_per_kib) * (slice / 1024) * 2.0 * f32::lanes * kStreamChains);
  state.SetLabel(std::string(isa::native::name) + ", " + std::to_string(kStreamChains) + " chains");
}

}  // namespace detail

/// The streaming read bandwidth of `threads` threads now, in bytes per second: the best of
/// `passes` passes over the bandwidth buffer, each thread summing its own slice as
/// machine/read_bandwidth does. A memory-bound benchmark calls it right after its timing loop,
/// so that its fraction of the limit compares two rates measured at the same moment: on a
/// shared machine the bandwidth left to this program drifts by tens of percent within a run.
/// Throws std::bad_alloc if the buffer cannot be had.
inline double read_bandwidth_now(int threads, int passes = 2) {
  const std::byte* buffer = detail::read_buffer();
  const std::size_t slice = read_buffer_bytes() / static_cast<std::size_t>(threads) / 256 * 256;
  double best = 0.0;
  for (int pass = 0; pass < passes; ++pass)
    with_parallel_for(threads, [&](auto&& pf) {
      std::vector<std::uint64_t> sums(static_cast<std::size_t>(threads));
      const auto start = std::chrono::steady_clock::now();
      pf(threads, [&](std::int64_t i) {
        const std::byte* begin = buffer + static_cast<std::size_t>(i) * slice;
        sums[static_cast<std::size_t>(i)] = detail::read_pass(begin, begin + slice);
      });
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      benchmark::DoNotOptimize(sums.data());
      best = std::max(best, static_cast<double>(slice) * threads / seconds);
    });
  return best;
}

/// Sets the counters read_bw (read_bandwidth_now(threads), bytes per second) and of_read_bw
/// (`bytes_per_second` of the benchmark over it) after a memory-bound benchmark's timing loop.
inline void report_read_fraction(benchmark::State& state, double bytes_per_second, int threads) {
  const double limit = read_bandwidth_now(threads);
  state.counters["read_bw"] = benchmark::Counter(limit, benchmark::Counter::kDefaults, benchmark::Counter::kIs1024);
  state.counters["of_read_bw"] = limit > 0 ? bytes_per_second / limit : 0.0;
}

/// Registers the machine/ benchmarks in this program, after those registered so far (so they
/// run last). Idempotent. KVATTN_BENCHMARK_MAIN() calls it.
inline void register_machine_limits() {
  static const bool registered = [] {
    const int cores = static_cast<int>(std::thread::hardware_concurrency());
    auto* read = benchmark::RegisterBenchmark("machine/read_bandwidth", detail::bm_read_bandwidth);
    auto* fma = benchmark::RegisterBenchmark("machine/fma_peak_f32", detail::bm_fma_peak_f32);
    read->Unit(benchmark::kMillisecond);
    fma->Unit(benchmark::kMicrosecond);
    for (auto* b : {read, fma}) {
      b->Threads(1)->Threads(2)->UseRealTime();
      if (cores > 2) b->Threads(cores);
    }
    return true;
  }();
  (void)registered;
}

/// Registers machine/read_with_fma (see the top of this file) for 0, 2, 4, 8, 12 and 16 FLOP
/// per byte, with the thread counts of the other limits. A program that calls it at static
/// initialization gets them before the limits, after its own benchmarks registered before it.
inline void register_read_with_fma() {
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  auto* b = benchmark::RegisterBenchmark("machine/read_with_fma", detail::bm_read_with_fma);
  b->ArgName("flop_per_byte")->Arg(0)->Arg(2)->Arg(4)->Arg(8)->Arg(12)->Arg(16);
  b->Unit(benchmark::kMillisecond)->Threads(1)->Threads(2)->UseRealTime();
  if (cores > 2) b->Threads(cores);
}

/// The body of main() for a kvattn benchmark program: the program's own benchmarks plus the
/// machine limits, in one run. Returns the process's exit status.
inline int benchmark_main(int argc, char** argv) {
  register_machine_limits();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

KVATTN_END_TARGET_NAMESPACE
}  // namespace kvattn::bench

/// Use in place of BENCHMARK_MAIN() in every kvattn benchmark program.
#define KVATTN_BENCHMARK_MAIN() \
  int main(int argc, char** argv) { return ::kvattn::bench::benchmark_main(argc, argv); }
