// Decode with both a sliding window and a logit soft-cap (Compose<SlidingWindow, SoftCap>) against the
// reference, with the bounds of test_decode.cpp.
#include <kvattn/decode.hpp>

#include <gtest/gtest.h>

#include "decode_check.hpp"

namespace {

using kvattn::GqaShape;
using Case = decode_check::Case;
using Both = kvattn::Compose<kvattn::SlidingWindow, kvattn::SoftCap>;

template <class P> class DecodeWindowSoftCap : public ::testing::Test {};
TYPED_TEST_SUITE(DecodeWindowSoftCap, decode_check::Isas);

TYPED_TEST(DecodeWindowSoftCap, WindowAndCapTogether) {
  using Isa = typename TypeParam::type;
  using decode_check::check_all_storage;
  check_all_storage<Both, Isa>(Case{GqaShape::gqa(8, 4, 128), 16, {300, 5}, 2, 64, 30.0f, 70, 40.0f});
  check_all_storage<Both, Isa>(Case{GqaShape::gqa(9, 3, 7), 1, {0, 1, 30}, 3, 4, 3.0f, 0, 8.0f});  // odd head size
}

}  // namespace
