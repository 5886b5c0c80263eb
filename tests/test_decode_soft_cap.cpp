// Decode with a logit soft-cap (the SoftCap policy: scores become cap · tanh(score / cap))
// against the reference, with the bounds of test_decode.cpp. Large queries make the cap bite.
#include <kvattn/decode.hpp>

#include <gtest/gtest.h>

#include "decode_check.hpp"

namespace {

using kvattn::GqaShape;
using Case = decode_check::Case;
using kvattn::SoftCap;

template <class P> class DecodeSoftCap : public ::testing::Test {};
TYPED_TEST_SUITE(DecodeSoftCap, decode_check::Isas);

TYPED_TEST(DecodeSoftCap, CapsTheLogits) {
  using Isa = typename TypeParam::type;
  using decode_check::check_all_storage;
  check_all_storage<SoftCap, Isa>(Case{GqaShape::gqa(8, 2, 64), 16, {100, 5}, 1, 0, 5.0f, 0, 40.0f});
  check_all_storage<SoftCap, Isa>(Case{GqaShape::gqa(3, 1, 256), 7, {0, 1, 8, 60}, 1, 0, 2.0f, 0, 10.0f});  // group 3
}

TYPED_TEST(DecodeSoftCap, SplitAcrossThreads) {
  using Isa = typename TypeParam::type;
  kvattn::ThreadPool pool(3);
  decode_check::check_all_storage<SoftCap, Isa>(Case{GqaShape::gqa(8, 8, 128), 16, {900, 17}, 1, 0, 20.0f, 100, 30.0f}, pool);
}

}  // namespace
