// Decode with the score policies engines ask for beyond the window and the soft-cap, against the
// reference (reference.hpp writes each policy again in double), with the bounds of
// test_decode.cpp: attention sinks (counted once however the keys are split), ALiBi (slopes of
// head counts that are not powers of two, any group size), tree masks over the new tokens (Q up
// to 16), and the compositions engines use (gpt-oss: window and sinks, here with a soft-cap too;
// ALiBi with sinks; a tree under a window). The policies' hooks act on scores, whatever the
// storage: fp32 and bf16 are run (fp16 differs from bf16 only in its loads, which
// test_decode.cpp runs).
#include <kvattn/decode.hpp>

#include <gtest/gtest.h>

#include "decode_check.hpp"

namespace {

using kvattn::GqaShape;
using Case = decode_check::Case;

// The native ISA only: the hooks act on a tile's scores the same way on every ISA, the scalar
// preset runs these tests as its native path, and test_x86_isas runs every policy, composed, on
// AVX2 and AVX-512.
template <class P> class DecodePolicies : public ::testing::Test {};
using NativeIsa = ::testing::Types<decode_check::IsaTag<kvattn::isa::native>>;
TYPED_TEST_SUITE(DecodePolicies, NativeIsa);

template <class P, class Isa, class PF = kvattn::SerialFor> void check_fp32_bf16(const Case& c, PF&& pf = PF{}) {
  decode_check::check<P, float, Isa>(c, pf);
  decode_check::check<P, kvattn::bf16, Isa>(c, pf);
}

TYPED_TEST(DecodePolicies, SinksJoinTheDenominatorOnce) {
  using Isa = typename TypeParam::type;
  using kvattn::Sinks;
  check_fp32_bf16<Sinks, Isa>(Case{GqaShape::gqa(8, 2, 64), 16, {100, 0, 1, 33}});             // context 0: out 0, lse = sink
  check_fp32_bf16<Sinks, Isa>(Case{GqaShape::gqa(6, 2, 80), 7, {40, 3, 2}, 3});                 // group 3, odd head size, Q = 3
  check_fp32_bf16<Sinks, Isa>(Case{GqaShape::gqa(3, 3, 128), 1, {20, 1}, 1, 0, 0.0f, 0, 8.0f});  // page 1, large logits
  kvattn::ThreadPool pool(3);
  check_fp32_bf16<Sinks, Isa>(Case{GqaShape::gqa(8, 1, 128), 16, {1500, 7}, 2, 0, 0.0f, 100}, pool);  // 15 chunks, one sink
}

TYPED_TEST(DecodePolicies, AlibiForEveryGroupSize) {
  using Isa = typename TypeParam::type;
  using kvattn::Alibi;
  for (int group : {1, 3, 8}) check_fp32_bf16<Alibi, Isa>(Case{GqaShape::gqa(2 * group, 2, 64), 7, {90, 1, 0}, 2});
  check_fp32_bf16<Alibi, Isa>(Case{GqaShape::gqa(12, 4, 80), 16, {300, 64}, 1});  // 12 heads: slopes of 8 and of 16
  kvattn::ThreadPool pool(2);
  check_fp32_bf16<Alibi, Isa>(Case{GqaShape::mha(5, 128), 16, {2000, 3}, 1, 0, 0.0f, 256}, pool);
}

TYPED_TEST(DecodePolicies, TreeMasksOverTheNewTokens) {
  using Isa = typename TypeParam::type;
  using kvattn::TreeMask;
  check_fp32_bf16<TreeMask, Isa>(Case{GqaShape::gqa(8, 2, 64), 16, {100, 40, 16}, 16});  // Q = 16: a draft tree of 16
  check_fp32_bf16<TreeMask, Isa>(Case{GqaShape::gqa(6, 2, 7), 7, {50, 5, 3}, 5});        // sequences shorter than Q
  check_fp32_bf16<TreeMask, Isa>(Case{GqaShape::gqa(4, 4, 128), 1, {30, 9}, 1});         // Q = 1: the mask is its own token
  kvattn::ThreadPool pool(3);
  check_fp32_bf16<TreeMask, Isa>(Case{GqaShape::gqa(8, 8, 64), 16, {1200}, 12, 0, 0.0f, 64}, pool);
}

TYPED_TEST(DecodePolicies, CompositionsEnginesUse) {
  using Isa = typename TypeParam::type;
  using Gpt = kvattn::Compose<kvattn::SlidingWindow, kvattn::SoftCap, kvattn::Sinks>;
  check_fp32_bf16<Gpt, Isa>(Case{GqaShape::gqa(8, 2, 64), 16, {200, 5, 0}, 1, 40, 20.0f, 0, 4.0f});
  check_fp32_bf16<Gpt, Isa>(Case{GqaShape::gqa(9, 3, 7), 7, {0, 1, 60}, 3, 1, 5.0f});  // window 1: the row's own token
  kvattn::ThreadPool pool(3);
  check_fp32_bf16<Gpt, Isa>(Case{GqaShape::gqa(8, 1, 128), 16, {1500, 3}, 2, 150, 30.0f, 100, 10.0f}, pool);  // chunks outside the window
  using AlibiSinks = kvattn::Compose<kvattn::Alibi, kvattn::Sinks>;
  check_fp32_bf16<AlibiSinks, Isa>(Case{GqaShape::gqa(12, 4, 64), 16, {300, 2}, 2});
  using WindowTree = kvattn::Compose<kvattn::SlidingWindow, kvattn::TreeMask>;
  check_fp32_bf16<WindowTree, Isa>(Case{GqaShape::gqa(8, 2, 64), 7, {80, 12}, 10, 6});  // the window cuts into the tree
}

}  // namespace
