// The compiled kernels (kvattn/kernels.hpp): every instruction set this CPU runs, chosen with
// set_isa, against the double-precision reference, over awkward shapes, for every compiled
// format and policy of decode, prefill and MLA decode; the choice itself (KVATTN_ISA, set_isa's
// errors).
//
// This program is compiled for the architecture's baseline (not -march=native) and instantiates
// no kernel: CTest also runs it under qemu-x86_64 as CPUs without AVX2 and without AVX-512, where
// it must choose the scalar and the AVX2 kernels (KVATTN_TEST_EXPECT_ISA) and pass, which it
// cannot if any code compiled for a richer set runs before the dispatcher's check.
#include <kvattn/kernels.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "attention_checks.hpp"
#include "mla_reference.hpp"

namespace {

using checks::DecodeCase;
using kvattn::GqaShape;

// The cases: group sizes 1, 3 and 8 (and MHA), head sizes with a kernel of their own (64, 128,
// 256) and not (40, 72), page sizes 1, 7 and 16, contexts 0 and 1, several queries per sequence,
// split into chunks, windows shorter and longer than the context, soft-caps that bite (queries
// scaled up). A policy with a window or a cap runs on the cases that have one.
std::vector<DecodeCase> cases() {
  return {
      {GqaShape::gqa(8, 1, 64), 16, {1, 0, 37}},
      {GqaShape::gqa(6, 2, 40), 7, {19, 1}, 1, 5, 5.0f, 0, 8.0f},
      {GqaShape::gqa(8, 8, 128), 1, {9}, 2},
      {GqaShape::gqa(16, 2, 128), 16, {700, 5}, 1, 100, 20.0f, 256, 10.0f},
      {GqaShape::gqa(24, 3, 72), 7, {300}, 3, 1000, 0.0f, 0},
      {GqaShape::gqa(8, 1, 256), 16, {129, 2}, 2, 33, 2.0f, 0, 4.0f},
  };
}

template <class T, class P, class PF> void check(const DecodeCase& c, PF& pf) {
  SCOPED_TRACE(checks::describe(c) + " format=" + std::string(kvattn::format_traits<T>::name) +
               " isa=" + std::string(kvattn::kernels::isa()));
  checks::check_decode_case<T, P>(c, pf, [](const kvattn::PagedKvView<T>& kv, const float* q, float* out, float* lse,
                                            kvattn::DecodePlan& plan, PF& parallel_for, const P& policy) {
    kvattn::kernels::decode(kv, q, out, lse, plan, parallel_for, policy);
  });
}

template <class T, class PF> void check_policies(const DecodeCase&, PF&, kvattn::kernels::type_list<>) {}
template <class T, class PF, class P, class... Ps>
void check_policies(const DecodeCase& c, PF& pf, kvattn::kernels::type_list<P, Ps...>) {
  const bool runs = (!policy_checks::uses_v<P, kvattn::SlidingWindow> || c.window > 0) &&
                    (!policy_checks::uses_v<P, kvattn::SoftCap> || c.soft_cap > 0);
  if (runs) check<T, P>(c, pf);
  check_policies<T>(c, pf, kvattn::kernels::type_list<Ps...>{});
}
template <class PF, class... T> void check_all(PF& pf, kvattn::kernels::type_list<T...>) {
  for (const DecodeCase& c : cases()) (check_policies<T>(c, pf, kvattn::kernels::decode_policies{}), ...);
}

// ---- prefill: one sequence's prompt in chunks, every token against the reference ------------------

struct PrefillCase {
  GqaShape shape;
  int page_size;
  std::vector<std::int64_t> chunks;
  int query_block = 64;
  std::int64_t window = 0;
};

template <class T, class P, class PF> void check_prefill(const PrefillCase& c, PF& pf) {
  std::int64_t total = 0;
  for (std::int64_t n : c.chunks) total += n;
  std::string chunks;
  for (std::int64_t n : c.chunks) chunks += std::to_string(n) + ",";
  SCOPED_TRACE(kvattn::detail::concat("q_heads=", c.shape.q_heads, " kv_heads=", c.shape.kv_heads, " head_dim=", c.shape.head_dim,
                                      " page=", c.page_size, " chunks=", chunks, " block=", c.query_block, " window=", c.window,
                                      " format=", kvattn::format_traits<T>::name, " isa=", kvattn::kernels::isa()));
  const GqaShape& s = c.shape;
  kvattn::PagedKvCache<T> cache(kvattn::CacheConfig{1, c.page_size, (total + c.page_size - 1) / c.page_size + 1, s});
  const kvattn::SeqId seq = cache.add_sequence();
  const checks::Prompt pr = checks::random_prompt(s, total, static_cast<unsigned>(total * 7 + s.head_dim));
  const policy_checks::Values values(s.q_heads, {0, total}, c.window, 0.0f, static_cast<unsigned>(total));
  std::vector<float> out(static_cast<std::size_t>(total) * s.q_heads * s.head_dim, 7.0f),
      lse(static_cast<std::size_t>(total) * s.q_heads, 7.0f);
  kvattn::PrefillParams params;
  params.query_block = c.query_block;
  kvattn::PrefillPlan plan;
  std::int64_t done = 0;
  for (std::int64_t n : c.chunks) {
    cache.append(seq, n);
    plan.make(cache, kvattn::ChunkBatch{{seq, n}}, s, params, pf);
    const std::size_t qo = static_cast<std::size_t>(done) * s.q_heads * s.head_dim;
    const std::size_t kv = static_cast<std::size_t>(done) * s.kv_heads * s.head_dim;
    kvattn::kernels::prefill(cache, 0, pr.q.data() + qo, pr.k.data() + kv, pr.v.data() + kv, out.data() + qo,
                             lse.data() + static_cast<std::size_t>(done) * s.q_heads, plan, pf, policy_checks::make<P>(values));
    done += n;
  }
  std::vector<double> ref, ref_lse;
  reference::decode(cache, seq, 0, s, pr.q.data(), policy_checks::options<P>(values, 0), ref, ref_lse);
  const double e_s = std::ldexp(1.0, -23) * std::sqrt(double(s.head_dim));  // one fp32 score's rounding (|q|, |k| <= 1)
  checks::expect_out_close(out, ref, "out", e_s);
  checks::expect_lse_close(lse, ref_lse, "lse", e_s);
}

// Group sizes 1, 3 and 8 (and MHA, MQA), head sizes with a kernel of their own and not, pages of
// 1, 7 and 16, prompts of one token and in uneven chunks, query blocks shorter than a chunk.
std::vector<PrefillCase> prefill_cases() {
  return {
      {GqaShape::gqa(8, 1, 64), 16, {45}, 64, 16},
      {GqaShape::gqa(6, 2, 40), 7, {20, 1, 30}, 8, 9},
      {GqaShape::mha(5, 128), 1, {33}, 64, 40},
      {GqaShape::gqa(24, 3, 72), 7, {1}, 64, 1},
      {GqaShape::mqa(8, 256), 16, {40, 9}, 16, 20},
  };
}

template <class T, class PF, class... P> void check_prefill_policies(PF& pf, kvattn::kernels::type_list<P...>) {
  for (const PrefillCase& c : prefill_cases()) (check_prefill<T, P>(c, pf), ...);
}
template <class PF, class... T> void check_prefill_all(PF& pf, kvattn::kernels::type_list<T...>) {
  (check_prefill_policies<T>(pf, kvattn::kernels::prefill_policies{}), ...);
}

// ---- MLA decode: the latent attention against the reference --------------------------------------

template <class T, class P, class PF> void check_mla(const checks::MlaCase& c, PF& pf) {
  SCOPED_TRACE(checks::describe(c) + " format=" + std::string(kvattn::format_traits<T>::name) +
               " isa=" + std::string(kvattn::kernels::isa()));
  checks::check_mla_case<T, P>(c, 1, pf, [](const kvattn::PagedKvView<T>& kv, const float* q, float* out, float* lse,
                                            kvattn::DecodePlan& plan, PF& parallel_for, const P& policy) {
    kvattn::kernels::mla_decode(kv, q, out, lse, plan, parallel_for, policy);
  });
}

// Head layouts whose widths no vector divides (latent + rope = 46) and DeepSeek-V2-Lite's (512 +
// 64); pages of 1, 7 and 16; contexts 0, 1 and around a tile; two queries per sequence; split
// into chunks. The latent formats need whole blocks of 128.
template <class T> std::vector<checks::MlaCase> mla_cases() {
  const kvattn::MlaShape lite{16, 512, 64, 128, 128, 0}, odd{3, 40, 6, 16, 12, 0}, blocks{5, 384, 8, 24, 16, 32};
  const kvattn::MlaShape& narrow = kvattn::format_traits<T>::latent_block > 0 ? blocks : odd;
  return {
      {narrow, 1, {0, 1, 33}, 1},
      {narrow, 7, {250, 2}, 2},
      {lite, 16, {300, 31}, 1, 1.0f, 64},
  };
}

template <class T, class PF, class... P> void check_mla_policies(PF& pf, kvattn::kernels::type_list<P...>) {
  for (const checks::MlaCase& c : mla_cases<T>()) (check_mla<T, P>(c, pf), ...);
}
template <class PF, class... T> void check_mla_all(PF& pf, kvattn::kernels::type_list<T...>) {
  (check_mla_policies<T>(pf, kvattn::kernels::mla_decode_policies{}), ...);
}

// Restores the choice the program started with when a test has changed it.
class Kernels : public ::testing::Test {
 protected:
  void SetUp() override { start_ = std::string(kvattn::kernels::isa()); }
  void TearDown() override { kvattn::kernels::set_isa(start_); }
  std::string start_;
};

TEST_F(Kernels, ChoosesTheBestThisCpuRunsOrWhatKvattnIsaNames) {
  const std::vector<std::string_view> isas = kvattn::kernels::isas();
  ASSERT_FALSE(isas.empty());
  EXPECT_EQ(isas.back(), "scalar");  // every CPU runs it, and it is the least
  const char* env = std::getenv("KVATTN_ISA");
  EXPECT_EQ(start_, env != nullptr ? std::string(env) : std::string(isas.front()));
  // Under an emulated CPU, CTest says what it must be.
  if (const char* expect = std::getenv("KVATTN_TEST_EXPECT_ISA")) {
    EXPECT_EQ(start_, expect);
    EXPECT_EQ(std::string(isas.front()), expect) << "the best this CPU runs";
  }
}

TEST_F(Kernels, EveryInstructionSetMatchesTheReference) {
  for (std::string_view isa : kvattn::kernels::isas()) {
    kvattn::kernels::set_isa(isa);
    ASSERT_EQ(kvattn::kernels::isa(), isa);
    kvattn::SerialFor serial;
    check_all(serial, kvattn::kernels::decode_formats{});
    check_prefill_all(serial, kvattn::kernels::prefill_formats{});
    check_mla_all(serial, kvattn::kernels::mla_decode_formats{});
  }
}

TEST_F(Kernels, TakesAnyParallelFor) {
  kvattn::ThreadPool pool(3);
  check_all(pool, kvattn::kernels::decode_formats{});
  check_prefill_all(pool, kvattn::kernels::prefill_formats{});
  check_mla_all(pool, kvattn::kernels::mla_decode_formats{});
  // An engine's own, which does not tell its threads: items in reverse order.
  auto reverse = [](std::int64_t n, auto&& body) {
    for (std::int64_t i = n - 1; i >= 0; --i) body(i);
  };
  const DecodeCase c{GqaShape::gqa(16, 2, 128), 16, {700, 5}, 1, 100, 0.0f, 256};
  check<kvattn::bf16, kvattn::SlidingWindow>(c, reverse);
  EXPECT_EQ(kvattn::ParallelForRef(reverse).threads(), kvattn::hardware_threads());
  EXPECT_EQ(kvattn::ParallelForRef(pool).threads(), 3);
  EXPECT_EQ(kvattn::ParallelForRef().threads(), 1);
}

TEST_F(Kernels, SetIsaRejectsWhatIsNotThere) {
  const std::string before(kvattn::kernels::isa());
  for (const char* bad : {"avx9", "", "AVX2", "native"}) {
    try {
      kvattn::kernels::set_isa(bad);
      ADD_FAILURE() << "set_isa(\"" << bad << "\") did not throw";
    } catch (const kvattn::invalid_argument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("kvattn::kernels::set_isa: name=\"" + std::string(bad) + "\""), std::string::npos) << what;
      EXPECT_NE(what.find("scalar"), std::string::npos) << what;  // the list of what there is
    }
    EXPECT_EQ(kvattn::kernels::isa(), before);
  }
  kvattn::kernels::set_isa("scalar");
  EXPECT_EQ(kvattn::kernels::isa(), "scalar");
  kvattn::kernels::set_isa("best");
  EXPECT_EQ(kvattn::kernels::isa(), kvattn::kernels::isas().front());
}

TEST_F(Kernels, ChecksTheCallAsDecodeDoes) {
  const DecodeCase c{GqaShape::gqa(8, 2, 64), 16, {5, 9}};
  const checks::DecodeInputs<kvattn::fp16> in(c);
  std::vector<float> out = in.out(), lse = in.lse(c);
  const kvattn::BatchPageTable table = in.cache.page_table(in.seqs);
  kvattn::DecodePlan plan;
  plan.make(in.cache.view(table, 0), c.shape, checks::decode_params(c), 1);
  const std::vector<float> out_before = out;
  EXPECT_THROW(kvattn::kernels::decode(in.cache.view(table, 0), in.q.data(), out.data(), lse.data(), plan, {},
                                       kvattn::SlidingWindow{0}),
               kvattn::invalid_argument);
  EXPECT_EQ(out, out_before);
}

}  // namespace

// Run by CTest with KVATTN_ISA=avx9 (kernels.kvattn_isa_unknown): the first use is an error that
// names the variable and its value, and so is every later one.
TEST(KernelsEnvironment, AnUnknownKvattnIsaIsAnError) {
  const char* env = std::getenv("KVATTN_ISA");
  if (env == nullptr || std::string(env) != "avx9") GTEST_SKIP() << "run by CTest with KVATTN_ISA=avx9";
  for (int call = 0; call < 2; ++call) {
    try {
      (void)kvattn::kernels::isa();
      ADD_FAILURE() << "isa() did not throw";
    } catch (const kvattn::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("KVATTN_ISA=\"avx9\""), std::string::npos) << e.what();
    }
  }
  kvattn::kernels::set_isa("scalar");  // an explicit choice stands over the environment's
  EXPECT_EQ(kvattn::kernels::isa(), "scalar");
}
