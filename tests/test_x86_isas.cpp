// The AVX2 and AVX-512 kernels, whatever -march=native selects on the machine that builds them (but
// the one it selects, whose kernels every other kernel test runs, and those the machine cannot run,
// which the build only compiles):
// isa_kernels_avx2*.cpp are compiled with -march=x86-64-v3 and isa_kernels_avx512*.cpp with
// -march=x86-64-v4, and this file, compiled for the x86-64 baseline, runs them where the CPU has
// the instruction set and skips them, saying which set is missing, where it has not.
//
// For each of the two: decode over group sizes 1, 3, 4, 8, MHA and MQA, head sizes 64, 128, 256,
// 80 and 7, page sizes 1, 7, 16, contexts 0, 1, page size ± 1 and thousands, several queries per
// sequence, sliding window, soft-cap and huge logits, serial and threaded, split-KV; prefill over
// group sizes 1, 3, 4, 8, head sizes 64, 128, 256, 80, 7, chunked prompts up to 500 tokens,
// query blocks, variants; MLA decode in latent space (mla_decode) over DeepSeek-V2's head layout
// and awkward widths, several queries, split, threaded, huge logits; RoPE in both styles, whole
// and partial widths; fp16 and bf16 to fp32 and back. Storage fp32, fp16 and bf16 throughout,
// and int8_row, fp8_e4m3_row and (the plain policy) q4_block for decode and prefill.
//
// Bounds, the same as the tests of the native path:
//  - decode and prefill, element-wise against reference.hpp (test_decode.cpp, test_prefill.cpp):
//    |out - ref| <= (2e-5 + 2·e_s) · max|v| + 2e-5 · |ref|, |lse - ref| <= 2e-5 · (1 + |ref|) + e_s,
//    e_s = 2^-23 · scale · head_dim · max|q| · max|k|, the rounding of one fp32 score;
//  - MLA decode against mla_reference.hpp, with the same form of bound (e_s over latent_dim +
//    rope_dim);
//  - RoPE against an exact rotation in double (test_rope.cpp): |got − ref| <= 4 · 2^-24 · (|a| + |b|)
//    for the input pair (a, b); pass-through elements and position 0 bit-identical;
//  - conversions bit for bit equal to the element-wise to_float / from_float (which test_storage.cpp
//    checks against IEEE 754), except that an fp16 NaN need only stay a NaN of its sign.
#include "isa_kernels.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "attention_checks.hpp"
#include "mla_reference.hpp"
#include "policy_checks.hpp"
#include "reference.hpp"
#include "rope_reference.hpp"

namespace {

using kvattn::GqaShape;
namespace isa = kvattn::isa;

// ---- Which instruction sets this CPU runs ------------------------------------------------------

/// Whether this CPU (and its operating system) runs code compiled with -march=x86-64-v3, and the
/// features kvattn's AVX2 kernels use. GCC knows the level's name; Clang (14) knows neither it
/// nor F16C, so there the features are asked one by one (every CPU with AVX2 and FMA has F16C).
bool cpu_runs_avx2() {
#if defined(__clang__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi") &&
         __builtin_cpu_supports("bmi2");
#else
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
         __builtin_cpu_supports("x86-64-v3");
#endif
}

/// The same for -march=x86-64-v4 and the AVX-512 kernels (F, BW, DQ, VL).
bool cpu_runs_avx512() {
  const bool features = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
#if defined(__clang__)
  return features && __builtin_cpu_supports("avx512cd") && cpu_runs_avx2();
#else
  return features && __builtin_cpu_supports("x86-64-v4");
#endif
}

template <class Isa> struct Cpu;
// (`missing` is unused for the set -march=native selects: the other kernel tests run it, and this
// program does not compile it.)
template <> struct Cpu<isa::avx2> {
  static bool runs() { return cpu_runs_avx2(); }
  [[maybe_unused]] static constexpr const char* missing =
      "AVX2 (avx2/fma/f16c, x86-64-v3) is not available on this CPU: the AVX2 kernels were compiled but not run";
};
template <> struct Cpu<isa::avx512> {
  static bool runs() { return cpu_runs_avx512(); }
  [[maybe_unused]] static constexpr const char* missing =
      "AVX-512 (avx512f/bw/dq/vl, x86-64-v4) is not available on this CPU: the AVX-512 kernels were compiled but not run";
};

TEST(IsaCpu, SaysWhichKernelsRun) {
  std::printf("AVX2 kernels: %s; AVX-512 kernels: %s\n", cpu_runs_avx2() ? "run" : "skipped (not on this CPU)",
              cpu_runs_avx512() ? "run" : "skipped (not on this CPU)");
  EXPECT_TRUE(!cpu_runs_avx512() || cpu_runs_avx2()) << "x86-64-v4 includes x86-64-v3";
}

/// Every test below is typed over the two instruction sets and skipped, with the reason, where
/// this CPU lacks the set: nothing compiled for it runs before SetUp has asked.
template <class Isa> class OnThisCpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!Cpu<Isa>::runs()) GTEST_SKIP() << Cpu<Isa>::missing;
  }
};
// The build leaves out the instruction set -march=native selects, which every other kernel test
// runs, and the ones the machine that configured it cannot run, which it only compiles
// (tests/CMakeLists.txt): KVATTN_TEST_X86_AVX2 and KVATTN_TEST_X86_AVX512 say which it has.
#if !defined(KVATTN_TEST_X86_AVX2) || !defined(KVATTN_TEST_X86_AVX512)
#error "tests/CMakeLists.txt defines KVATTN_TEST_X86_AVX2 and KVATTN_TEST_X86_AVX512"
#elif KVATTN_TEST_X86_AVX2 && KVATTN_TEST_X86_AVX512
using Isas = ::testing::Types<isa::avx2, isa::avx512>;
#elif KVATTN_TEST_X86_AVX2
using Isas = ::testing::Types<isa::avx2>;
#elif KVATTN_TEST_X86_AVX512
using Isas = ::testing::Types<isa::avx512>;
#else
#error "test_x86_isas is built only when it has kernels to run"
#endif
struct IsaName {
  template <class Isa> static std::string GetName(int) { return std::string(Isa::name); }
};

template <class Isa, class T> using K = isa_kernels::Kernels<Isa, T>;

// ---- Decode --------------------------------------------------------------------------------------

using checks::DecodeCase;

using isa_kernels::Policy;
/// The policy of a case: its window and soft-cap where it has them.
Policy policy_of(std::int64_t window, float soft_cap) {
  return window > 0 ? (soft_cap > 0 ? Policy::window_soft_cap : Policy::window) : soft_cap > 0 ? Policy::soft_cap : Policy::plain;
}

/// As test_decode.cpp's check(), with the kernel of Isa and the policy `which` (by default the
/// case's: policy_of).
template <class Isa, class T>
void check_decode(const DecodeCase& c, kvattn::ThreadPool* pool = nullptr, Policy which = Policy::plain) {
  if (which == Policy::plain) which = policy_of(c.window, c.soft_cap);
  SCOPED_TRACE(describe(c) + " storage=" + std::string(kvattn::format_traits<T>::name) + " isa=" + std::string(Isa::name) +
               " threads=" + std::to_string(pool ? pool->threads() : 1) + " policy=" + std::to_string(static_cast<int>(which)));
  const checks::DecodeInputs<T> in(c);
  std::vector<float> out = in.out(), lse = in.lse(c);
  const kvattn::BatchPageTable table = in.cache.page_table(in.seqs);
  const policy_checks::Values values = checks::policy_values(c);
  K<Isa, T>::decode(in.cache.view(table, 0), c.shape, in.q.data(), out.data(), lse.data(), checks::decode_params(c), which, values,
                    pool);
  isa_kernels::with_policy(which, [&](auto tag) {
    checks::expect_decode_case_matches<typename decltype(tag)::type>(in, c, values, out, lse);
  });
}

template <class Isa> void check_decode_all_storage(const DecodeCase& c, kvattn::ThreadPool* pool = nullptr, Policy which = Policy::plain) {
  check_decode<Isa, float>(c, pool, which);
  check_decode<Isa, kvattn::fp16>(c, pool, which);
  check_decode<Isa, kvattn::bf16>(c, pool, which);
  check_decode<Isa, kvattn::int8_row>(c, pool, which);
  check_decode<Isa, kvattn::fp8_e4m3_row>(c, pool, which);
  // q4_block: the plain policy's kernel (isa_kernels::kPlainOnly), head sizes of whole blocks of 32.
  if (which == Policy::plain && policy_of(c.window, c.soft_cap) == Policy::plain && c.shape.head_dim % 32 == 0)
    check_decode<Isa, kvattn::q4_block>(c, pool, which);
}

template <class Isa> class IsaDecode : public OnThisCpu<Isa> {};
TYPED_TEST_SUITE(IsaDecode, Isas, IsaName);

TYPED_TEST(IsaDecode, GroupSizesAndHeadSizes) {
  for (int group : {1, 3, 4, 8})
    for (int dim : {64, 128, 256, 80, 7})
      check_decode_all_storage<TypeParam>(DecodeCase{GqaShape::gqa(2 * group, 2, dim), 16, {37, 1, 100}});
  check_decode_all_storage<TypeParam>(DecodeCase{GqaShape::mha(6, 64), 16, {50, 9}});   // groups = heads (MHA)
  check_decode_all_storage<TypeParam>(DecodeCase{GqaShape::mqa(12, 128), 16, {50, 9}});  // one group (MQA)
}

TYPED_TEST(IsaDecode, PageSizesAndAwkwardContexts) {
  for (int page : {1, 7, 16})
    check_decode_all_storage<TypeParam>(
        DecodeCase{GqaShape::gqa(8, 2, 64), page, {0, 1, page - 1 > 0 ? page - 1 : 2, page + 1, 3 * page, 5}});
  check_decode_all_storage<TypeParam>(DecodeCase{GqaShape::gqa(6, 2, 80), 7, {0}});  // nothing to attend to
}

TYPED_TEST(IsaDecode, LongContextsSplitAndThreaded) {
  kvattn::ThreadPool pool(3);
  check_decode_all_storage<TypeParam>(DecodeCase{GqaShape::gqa(8, 2, 128), 16, {3000}}, &pool);  // chunks chosen
  check_decode_all_storage<TypeParam>(DecodeCase{GqaShape::gqa(4, 4, 64), 7, {2500, 17, 0, 1200}, 1, 0, 0, 100}, &pool);
  check_decode<TypeParam, kvattn::bf16>(DecodeCase{GqaShape::gqa(8, 1, 256), 1, {2000}, 1, 0, 0, 333});
  check_decode<TypeParam, kvattn::fp16>(DecodeCase{GqaShape::gqa(3, 1, 7), 16, {4100}});
}

TYPED_TEST(IsaDecode, SeveralQueriesWindowSoftCapAndLargeLogits) {
  check_decode_all_storage<TypeParam>(DecodeCase{GqaShape::gqa(6, 2, 64), 7, {40, 3, 2, 16}, 3});
  check_decode_all_storage<TypeParam>(DecodeCase{GqaShape::gqa(6, 3, 80), 16, {500, 64}, 4, 0, 0, 50});
  check_decode_all_storage<TypeParam>(DecodeCase{GqaShape::gqa(8, 2, 64), 16, {100, 5, 33}, 1, 20});
  check_decode_all_storage<TypeParam>(DecodeCase{GqaShape::gqa(8, 2, 64), 7, {100, 5, 33}, 3, 1});
  check_decode_all_storage<TypeParam>(DecodeCase{GqaShape::gqa(8, 2, 64), 16, {100, 5}, 1, 0, 5.0f, 0, 40.0f});
  check_decode_all_storage<TypeParam>(DecodeCase{GqaShape::gqa(8, 4, 128), 16, {300, 5}, 2, 64, 30.0f, 70, 40.0f});
  // Queries of size ~1e4 make scores ~1e5: a naive exp overflows, the online softmax does not.
  check_decode<TypeParam, float>(DecodeCase{GqaShape::gqa(4, 2, 64), 16, {200, 3}, 1, 0, 0, 50, 1e4f});
}

TYPED_TEST(IsaDecode, EveryPolicyHookAtOnce) {
  // Window, soft-cap, ALiBi, sinks and a tree mask together (isa_kernels::All), split and threaded.
  kvattn::ThreadPool pool(3);
  check_decode_all_storage<TypeParam>(DecodeCase{GqaShape::gqa(8, 2, 64), 7, {300, 12, 1, 0}, 12, 40, 20.0f, 64, 4.0f}, &pool,
                                      Policy::all);
  check_decode_all_storage<TypeParam>(DecodeCase{GqaShape::gqa(9, 3, 80), 16, {100, 5}, 3, 200, 5.0f}, nullptr, Policy::all);
}

// ---- MLA decode ----------------------------------------------------------------------------------

/// As test_mla.cpp's check_kernel, with the kernel of Isa (and the policy `which`, its window
/// and cap from the case).
template <class Isa, class T>
void check_mla(const kvattn::MlaShape& s, int page_size, const std::vector<std::int64_t>& lengths, int Q,
               std::int64_t chunk = 0, float q_scale = 1.0f, kvattn::ThreadPool* pool = nullptr, Policy which = Policy::plain) {
  const checks::MlaCase c{s, page_size, lengths, Q, q_scale, chunk, 30, 15.0f};
  SCOPED_TRACE(describe(c) + " storage=" + std::string(kvattn::storage_traits<T>::name) + " isa=" + std::string(Isa::name) +
               " policy=" + std::to_string(static_cast<int>(which)));
  const checks::MlaInputs<T> in(c, static_cast<unsigned>(lengths.size() * 7 + s.latent_dim));
  const std::size_t rows = in.seqs.size() * Q * s.heads;
  std::vector<float> out(rows * s.latent_dim, 123.0f), lse(rows, 123.0f);
  const kvattn::BatchPageTable table = in.cache.page_table(in.seqs);
  const policy_checks::Values values = checks::policy_values(c);
  K<Isa, T>::mla_decode(in.cache.view(table, 0), s, in.q.data(), out.data(), lse.data(), checks::mla_params(c), which, values, pool);
  isa_kernels::with_policy(which, [&](auto tag) {
    checks::expect_mla_decode_matches(in.cache, in.seqs, s, in.q, Q, out, lse, q_scale,
                                      [&](std::size_t b) { return policy_checks::options<typename decltype(tag)::type>(values, b); });
  });
}

template <class Isa> class IsaMla : public OnThisCpu<Isa> {};
TYPED_TEST_SUITE(IsaMla, Isas, IsaName);

TYPED_TEST(IsaMla, ShapesPagesContextsAndStorage) {
  const kvattn::MlaShape odd{3, 40, 6, 16, 12, 0}, one{1, 17, 2, 8, 8, 0}, lite{16, 512, 64, 128, 128, 0};
  for (int page : {1, 7, 16}) {
    check_mla<TypeParam, float>(odd, page, {0, 1, 31, 64, 65, 200}, 1);
    check_mla<TypeParam, kvattn::fp16>(one, page, {0, 1, 2, 100}, 3);
    check_mla<TypeParam, kvattn::bf16>(lite, page, {1, 70}, 2);
  }
}

TYPED_TEST(IsaMla, DeepSeekV2SplitThreadedAndLargeLogits) {
  kvattn::ThreadPool pool(3);
  const kvattn::MlaShape v2{128, 512, 64, 128, 128, 1536};
  check_mla<TypeParam, kvattn::bf16>(v2, 16, {600, 1}, 1, 0, 1.0f, &pool);
  check_mla<TypeParam, float>({5, 64, 8, 24, 16, 32}, 7, {1000, 0, 130}, 2, 64, 1.0f, &pool);
  check_mla<TypeParam, kvattn::fp16>({3, 40, 6, 16, 12, 0}, 16, {300, 5}, 2, 0, 300.0f);
  // Every policy hook at once (window 30, cap 15, ALiBi, sinks, a tree over Q = 5).
  check_mla<TypeParam, kvattn::bf16>({3, 40, 6, 16, 12, 0}, 7, {400, 5, 0}, 5, 64, 3.0f, &pool, Policy::all);
  check_mla<TypeParam, float>({5, 64, 8, 24, 16, 32}, 16, {90}, 1, 0, 1.0f, nullptr, Policy::all);
}

// ---- Prefill -------------------------------------------------------------------------------------

using checks::expect_close;
using checks::Prompt;
using checks::random_prompt;


/// As test_prefill.cpp's check_against_reference(): prefills one prompt in the given chunks (on a
/// pool of 2 threads), then compares every token's output and lse with the reference.
template <class Isa, class T>
void check_prefill(const GqaShape& s, int page, std::vector<std::int64_t> chunks, kvattn::PrefillParams params = {},
                   std::int64_t window = 0, float soft_cap = 0.0f, float q_scale = 1.0f, Policy which = Policy::plain) {
  if (which == Policy::plain) which = policy_of(window, soft_cap);
  SCOPED_TRACE(kvattn::detail::concat("q_heads=", s.q_heads, " kv_heads=", s.kv_heads, " head_dim=", s.head_dim, " page=", page,
                                      " storage=", kvattn::format_traits<T>::name, " isa=", Isa::name, " block=", params.query_block,
                                      " window=", window, " cap=", soft_cap, " policy=", static_cast<int>(which)));
  std::int64_t total = 0;
  for (auto c : chunks) total += c;
  kvattn::PagedKvCache<T> cache(kvattn::CacheConfig{1, page, (total + page - 1) / page + 1, s});
  const auto seq = cache.add_sequence();
  const Prompt pr = random_prompt(s, total, static_cast<unsigned>(total * 7 + s.head_dim), q_scale);
  std::vector<float> out(static_cast<std::size_t>(total) * s.q_heads * s.head_dim, 7.0f);  // [total][q_heads][head_dim]
  std::vector<float> lse(static_cast<std::size_t>(total) * s.q_heads, 7.0f);                // [total][q_heads]
  kvattn::ThreadPool pool(2);
  // The policies' values: a tree needs each chunk's rows, and is checked with one chunk only.
  const policy_checks::Values values(s.q_heads, {0, total}, window, soft_cap, static_cast<unsigned>(total));
  std::int64_t done = 0;
  for (auto n : chunks) {
    cache.append(seq, n);
    const std::size_t qo = static_cast<std::size_t>(done) * s.q_heads * s.head_dim;
    const std::size_t kv = static_cast<std::size_t>(done) * s.kv_heads * s.head_dim;
    K<Isa, T>::prefill(cache, seq, n, s, pr.q.data() + qo, pr.k.data() + kv, pr.v.data() + kv, out.data() + qo,
                       lse.data() + static_cast<std::size_t>(done) * s.q_heads, params, which, values, &pool);
    done += n;
  }
  reference::Options o;
  isa_kernels::with_policy(which, [&](auto tag) { o = policy_checks::options<typename decltype(tag)::type>(values, 0); });
  std::vector<double> ref, ref_lse;
  reference::decode(cache, seq, 0, s, pr.q.data(), o, ref, ref_lse);
  const double e_s = std::ldexp(1.0, -23) * q_scale * std::sqrt(double(s.head_dim));  // keys in [-1, 1]
  expect_close(out, ref, (2e-5 + 2 * e_s) * 1.0 /* max|v| */, 2e-5, "out");
  expect_close(lse, ref_lse, 2e-5 + e_s, 2e-5, "lse");
}

template <class Isa> class IsaPrefill : public OnThisCpu<Isa> {};
TYPED_TEST_SUITE(IsaPrefill, Isas, IsaName);

TYPED_TEST(IsaPrefill, MatchesReferenceOverShapes) {
  for (int group : {1, 3, 4, 8})
    for (int dim : {64, 128, 7}) {
      check_prefill<TypeParam, float>(GqaShape::gqa(2 * group, 2, dim), 16, {45});
      check_prefill<TypeParam, kvattn::bf16>(GqaShape::gqa(2 * group, 2, dim), 7, {20, 1, 30});
    }
  check_prefill<TypeParam, kvattn::fp16>(GqaShape::gqa(4, 2, 256), 16, {40, 9});
  check_prefill<TypeParam, kvattn::fp16>(GqaShape::mha(5, 80), 1, {33});
  check_prefill<TypeParam, kvattn::bf16>(GqaShape::mqa(8, 64), 16, {1});
  for (int group : {1, 3, 8}) check_prefill<TypeParam, kvattn::int8_row>(GqaShape::gqa(2 * group, 2, 64), 7, {20, 1, 30});
  check_prefill<TypeParam, kvattn::int8_row>(GqaShape::gqa(4, 2, 80), 1, {33});
  for (int group : {1, 3}) check_prefill<TypeParam, kvattn::fp8_e4m3_row>(GqaShape::gqa(2 * group, 2, 64), 7, {20, 1, 30});
  check_prefill<TypeParam, kvattn::fp8_e4m3_row>(GqaShape::gqa(4, 2, 80), 1, {33});
  for (int group : {1, 3}) check_prefill<TypeParam, kvattn::q4_block>(GqaShape::gqa(2 * group, 2, 64), 7, {20, 1, 30});
  check_prefill<TypeParam, kvattn::q4_block>(GqaShape::mha(3, 96), 1, {33});
}

TYPED_TEST(IsaPrefill, LongPromptAndBlocks) {
  kvattn::PrefillParams p;
  check_prefill<TypeParam, kvattn::bf16>(GqaShape::gqa(8, 2, 128), 16, {300, 200}, p);
  p.query_block = 5;
  check_prefill<TypeParam, kvattn::fp16>(GqaShape::gqa(6, 2, 64), 7, {100, 77}, p);
  p.query_block = 1;
  check_prefill<TypeParam, float>(GqaShape::gqa(4, 4, 64), 1, {50}, p);
}

TYPED_TEST(IsaPrefill, PoliciesAndLargeLogits) {
  check_prefill<TypeParam, float>(GqaShape::gqa(8, 2, 64), 16, {60, 40}, {}, 17);
  check_prefill<TypeParam, kvattn::bf16>(GqaShape::gqa(4, 2, 64), 7, {30}, {}, 1);
  check_prefill<TypeParam, float>(GqaShape::gqa(8, 2, 64), 16, {90}, {}, 40, 20.0f, 10.0f);
  check_prefill<TypeParam, kvattn::fp16>(GqaShape::gqa(6, 3, 80), 16, {64, 26}, {}, 0, 20.0f, 10.0f);
  check_prefill<TypeParam, float>(GqaShape::gqa(4, 2, 64), 16, {70}, {}, 0, 0.0f, 1e4f);  // scores ~1e5
  // Every policy hook at once (a tree over the one chunk of up to 64 tokens).
  kvattn::PrefillParams p;
  p.query_block = 5;
  check_prefill<TypeParam, kvattn::bf16>(GqaShape::gqa(8, 2, 64), 7, {40}, p, 16, 20.0f, 4.0f, Policy::all);
  check_prefill<TypeParam, float>(GqaShape::gqa(6, 2, 7), 1, {64}, {}, 100, 5.0f, 1.0f, Policy::all);
  check_prefill<TypeParam, kvattn::int8_row>(GqaShape::gqa(8, 2, 64), 7, {40}, p, 16, 20.0f, 4.0f, Policy::all);
}

// ---- RoPE ----------------------------------------------------------------------------------------

using kvattn::RopeConfig;
using kvattn::RopeStyle;




using reference::kRopeBound;
using reference::pair_members;
using reference::pair_scale;

/// reference::rope over vectors.
std::vector<double> reference_rope(RopeStyle style, int D, int R, double base, const std::vector<float>& x,
                                   std::int64_t tokens, int heads, const std::vector<std::int64_t>& positions) {
  return reference::rope(style, D, R, base, x.data(), tokens, heads, positions.data());
}

std::vector<float> random_vector(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& e : v) e = dist(rng);
  return v;
}

/// Rotates random heads with Isa's apply_rope and compares with the reference.
template <class Isa> void check_rope(const RopeConfig& c, int heads, const std::vector<std::int64_t>& positions, unsigned seed) {
  const std::int64_t tokens = static_cast<std::int64_t>(positions.size());
  SCOPED_TRACE(kvattn::detail::concat("style=", kvattn::to_string(c.style), " head_dim=", c.head_dim, " rotary_dim=", c.rotary_dim,
                                      " base=", c.base, " heads=", heads, " tokens=", tokens, " isa=", Isa::name));
  const int D = c.head_dim, R = c.rotary_dim == 0 ? c.head_dim : c.rotary_dim;
  const std::vector<float> x = random_vector(static_cast<std::size_t>(tokens * heads * D), seed);
  std::vector<float> got = x;
  const kvattn::Rope rope(c);
  isa_kernels::apply_rope<Isa>(rope, got.data(), tokens, heads, positions.data());
  const std::vector<double> ref = reference_rope(c.style, D, c.rotary_dim, c.base, x, tokens, heads, positions);
  int reported = 0;
  for (std::int64_t t = 0; t < tokens; ++t)
    for (int h = 0; h < heads; ++h) {
      const std::size_t off = static_cast<std::size_t>((t * heads + h) * D);
      const bool at_zero = positions[static_cast<std::size_t>(t)] == 0;
      for (int j = 0; j < D; ++j) {
        const std::size_t e = off + static_cast<std::size_t>(j);
        if (j >= R || at_zero) {  // bit-identical: not rotated, or rotated by the identity
          if (std::memcmp(&got[e], &x[e], sizeof(float)) != 0 && reported++ < 5)
            ADD_FAILURE() << "t=" << t << " h=" << h << " j=" << j << (j >= R ? " (pass-through)" : " (position 0)")
                          << ": got " << got[e] << ", input " << x[e];
          continue;
        }
        const double bound = kRopeBound * pair_scale(c.style, R, x.data() + off, j);
        const double err = std::abs(static_cast<double>(got[e]) - ref[e]);
        if (!(err <= bound) && reported++ < 5)
          ADD_FAILURE() << "t=" << t << " h=" << h << " j=" << j << ": got " << got[e] << ", reference " << ref[e]
                        << ", error " << err << ", bound " << bound;
      }
    }
}

template <class Isa> class IsaRope : public OnThisCpu<Isa> {};
TYPED_TEST_SUITE(IsaRope, Isas, IsaName);

TYPED_TEST(IsaRope, MatchesReferenceOverWidthsPositionsAndBases) {
  struct Widths {
    int head_dim, rotary_dim;
  };
  // Half-widths 1, 3, 2, 32, 40, 64, 128, 260: SIMD tails, whole vectors, several blocks.
  const Widths widths[] = {{2, 0}, {6, 0}, {7, 4}, {64, 0}, {80, 0}, {128, 0}, {128, 64}, {256, 0}, {600, 520}};
  const std::vector<std::int64_t> listed = {0, 1, 4095, 131071, 1000000};
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::int64_t> any_pos(0, std::int64_t{1} << 21);
  unsigned seed = 1;
  for (RopeStyle style : {RopeStyle::neox, RopeStyle::gptj})
    for (const Widths& w : widths)
      for (double base : {10000.0, 500000.0})
        for (int heads : {1, 8}) {
          std::vector<std::int64_t> many = listed;  // 37 tokens: every listed position, then random ones
          while (many.size() < 37) many.push_back(any_pos(rng));
          std::shuffle(many.begin(), many.end(), rng);
          check_rope<TypeParam>(RopeConfig{style, w.head_dim, w.rotary_dim, base}, heads, many, seed++);
          check_rope<TypeParam>(RopeConfig{style, w.head_dim, w.rotary_dim, base}, heads, {-1000000, 3}, seed++);
        }
}

// ---- fp16 / bf16 conversion ----------------------------------------------------------------------

template <class T> std::uint32_t bits_of(const T& x) {
  if constexpr (sizeof(T) == 4) {
    std::uint32_t b;
    std::memcpy(&b, static_cast<const void*>(&x), 4);
    return b;
  } else {
    std::uint16_t b;
    std::memcpy(&b, static_cast<const void*>(&x), 2);
    return b;
  }
}

template <class T> T from_bits(std::uint32_t b) {
  T x;
  if constexpr (sizeof(T) == 4) {
    std::memcpy(static_cast<void*>(&x), &b, 4);
  } else {
    const auto h = static_cast<std::uint16_t>(b);
    std::memcpy(static_cast<void*>(&x), &h, 2);
  }
  return x;
}

/// Whether a narrowing gave what the element-wise from_float<T> gives (`want`): the same bits,
/// or for fp16 NaNs, whose payload the contract leaves open, a NaN of the same sign.
template <class T> bool same_narrowed(T got, T want) {
  if (bits_of(got) == bits_of(want)) return true;
  const float g = kvattn::to_float(got), w = kvattn::to_float(want);
  return std::is_same_v<T, kvattn::fp16> && std::isnan(g) && std::isnan(w) && std::signbit(g) == std::signbit(w);
}
/// The same for a widening from T against to_float.
template <class T> bool same_widened(float got, float want) {
  if (bits_of(got) == bits_of(want)) return true;
  return std::is_same_v<T, kvattn::fp16> && std::isnan(got) && std::isnan(want) && std::signbit(got) == std::signbit(want);
}

/// fp32 inputs for narrowing to T: every value of T (the round trip), the ties halfway from each
/// to the next one away from zero and the floats just beside those ties, random bit patterns,
/// and specials (infinities, NaNs with low and high payloads, the largest finite fp32, fp32
/// subnormals, the overflow thresholds).
template <class T> std::vector<float> narrowing_inputs() {
  // T's values are fp32 values whose low `drop` significand bits are zero, except fp16's
  // subnormals (below 2^-14), which are multiples of 2^-24.
  constexpr int drop = std::is_same_v<T, kvattn::bf16> ? 16 : 13;
  std::vector<float> in;
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const float w = kvattn::to_float(from_bits<T>(h));
    in.push_back(w);
    if (!std::isfinite(w)) continue;
    const bool shifted = std::is_same_v<T, kvattn::bf16> || std::fabs(w) >= std::ldexp(1.0f, -14);
    const float tie = shifted ? from_bits<float>(bits_of(w) + (1u << (drop - 1))) : w + std::copysign(std::ldexp(1.0f, -25), w);
    in.push_back(tie);
    in.push_back(std::nextafter(tie, 0.0f));
    in.push_back(std::nextafter(tie, std::copysign(std::numeric_limits<float>::infinity(), tie)));
  }
  std::mt19937 rng(99);
  for (int i = 0; i < 20000; ++i) in.push_back(from_bits<float>(static_cast<std::uint32_t>(rng())));
  for (std::uint32_t b : {0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu,
                          0xffffffffu, 0x7fa00000u, 0x7f7fffffu, 0xff7fffffu, 0x00000001u, 0x807fffffu, 0x477ff000u,
                          0xc77ff000u, 0x7f7f8000u, 0xff7f8000u})
    in.push_back(from_bits<float>(b));
  return in;
}

template <class Isa, class T> void check_conversions() {
  SCOPED_TRACE(kvattn::detail::concat("storage=", kvattn::storage_traits<T>::name, " isa=", Isa::name));
  int reported = 0;
  // Widening: all 65,536 patterns.
  std::vector<T> all(65536);
  for (std::uint32_t h = 0; h < 65536; ++h) all[h] = from_bits<T>(h);
  std::vector<float> wide(all.size());
  K<Isa, T>::widen(all.data(), wide.data(), all.size());
  for (std::uint32_t h = 0; h < 65536; ++h)
    if (!same_widened<T>(wide[h], kvattn::to_float(all[h])) && reported++ < 8)
      ADD_FAILURE() << "widen " << std::hex << h << ": got bits " << bits_of(wide[h]) << ", want " << bits_of(kvattn::to_float(all[h]));
  // Narrowing: round trips, ties, random patterns and specials.
  const std::vector<float> in = narrowing_inputs<T>();
  std::vector<T> narrow(in.size());
  K<Isa, T>::narrow(in.data(), narrow.data(), in.size());
  for (std::size_t i = 0; i < in.size(); ++i) {
    const T want = kvattn::from_float<T>(in[i]);
    if (!same_narrowed(narrow[i], want) && reported++ < 8)
      ADD_FAILURE() << "narrow " << std::hex << bits_of(in[i]) << ": got bits " << bits_of(narrow[i]) << ", want " << bits_of(want);
  }
  // Every length 0..70 at offsets 0..2 (whole vectors, tails, masked tails), both ways: right
  // inside the row, nothing written outside it.
  constexpr std::size_t kGuard = 19;
  std::size_t pick = 0;
  for (std::size_t n = 0; n <= 70; ++n)
    for (std::size_t off : {0, 1, 2}) {
      std::vector<float> src(n);
      for (float& x : src) x = in[(pick += 7919) % in.size()];
      std::vector<T> dst(off + n + kGuard, from_bits<T>(0xA5A5u));
      K<Isa, T>::narrow(src.data(), dst.data() + off, n);
      std::vector<float> back(dst.size(), from_bits<float>(0xA5A5A5A5u));
      K<Isa, T>::widen(dst.data() + off, back.data() + off, n);
      for (std::size_t j = 0; j < dst.size(); ++j) {
        const bool inside = j >= off && j < off + n;
        const bool ok = inside ? same_narrowed(dst[j], kvattn::from_float<T>(src[j - off])) &&
                                     same_widened<T>(back[j], kvattn::to_float(dst[j]))
                               : bits_of(dst[j]) == 0xA5A5u && bits_of(back[j]) == 0xA5A5A5A5u;
        if (!ok && reported++ < 8)
          ADD_FAILURE() << "n=" << n << " offset " << off << " element " << j << (inside ? ": wrong value" : ": written outside the row");
      }
    }
}

template <class Isa> class IsaConvert : public OnThisCpu<Isa> {};
TYPED_TEST_SUITE(IsaConvert, Isas, IsaName);

TYPED_TEST(IsaConvert, Fp16MatchesElementWise) { check_conversions<TypeParam, kvattn::fp16>(); }
TYPED_TEST(IsaConvert, Bf16MatchesElementWise) { check_conversions<TypeParam, kvattn::bf16>(); }

}  // namespace
