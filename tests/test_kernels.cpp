// The compiled kernels (kvattn/kernels.hpp): every instruction set this CPU runs, chosen with
// set_isa, against the double-precision reference, over the decode cases' awkward shapes, for
// every compiled format and policy; the choice itself (KVATTN_ISA, set_isa's errors).
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

namespace {

using checks::DecodeCase;
using kvattn::GqaShape;

// The cases: group sizes 1, 3 and 8 (and MHA), head sizes with a kernel of their own (64, 128,
// 256) and not (40, 72), page sizes 1, 7 and 16, contexts 0 and 1, several queries per sequence,
// split into chunks, windows shorter and longer than the context.
std::vector<DecodeCase> cases() {
  return {
      {GqaShape::gqa(8, 1, 64), 16, {1, 0, 37}},
      {GqaShape::gqa(6, 2, 40), 7, {19, 1}, 1, 5},
      {GqaShape::gqa(8, 8, 128), 1, {9}, 2},
      {GqaShape::gqa(16, 2, 128), 16, {700, 5}, 1, 100, 0.0f, 256},
      {GqaShape::gqa(24, 3, 72), 7, {300}, 3, 1000, 0.0f, 0},
      {GqaShape::gqa(8, 1, 256), 16, {129, 2}, 2, 33},
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
  if (std::is_same_v<P, kvattn::SlidingWindow> && c.window == 0) return check_policies<T>(c, pf, kvattn::kernels::type_list<Ps...>{});
  check<T, P>(c, pf);
  check_policies<T>(c, pf, kvattn::kernels::type_list<Ps...>{});
}
template <class PF, class... T> void check_all(PF& pf, kvattn::kernels::type_list<T...>) {
  for (const DecodeCase& c : cases()) (check_policies<T>(c, pf, kvattn::kernels::decode_policies{}), ...);
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
  }
}

TEST_F(Kernels, TakesAnyParallelFor) {
  kvattn::ThreadPool pool(3);
  check_all(pool, kvattn::kernels::decode_formats{});
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
