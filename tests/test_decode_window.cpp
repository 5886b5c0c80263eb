// Decode with a sliding window (the SlidingWindow policy: each query attends to its last `window`
// positions) against the reference, with the bounds of test_decode.cpp. Windows of 1 (only the
// query's own position), shorter and longer than a page, and one wider than every context.
#include <kvattn/decode.hpp>

#include <gtest/gtest.h>

#include "decode_check.hpp"

namespace {

using kvattn::GqaShape;
using Case = decode_check::Case;
using Window = kvattn::SlidingWindow;

template <class P> class DecodeWindow : public ::testing::Test {};
TYPED_TEST_SUITE(DecodeWindow, decode_check::Isas);

TYPED_TEST(DecodeWindow, AttendsToTheLastWTokens) {
  using Isa = typename TypeParam::type;
  using decode_check::check_all_storage;
  check_all_storage<Window, Isa>(Case{GqaShape::gqa(8, 2, 64), 16, {100, 5, 33}, 1, 20});
  check_all_storage<Window, Isa>(Case{GqaShape::gqa(8, 2, 64), 7, {100, 5, 33}, 3, 1});       // 3 queries, window 1
  check_all_storage<Window, Isa>(Case{GqaShape::gqa(6, 2, 80), 1, {0, 1, 2, 40}, 1, 3});      // group 3, page 1
  check_all_storage<Window, Isa>(Case{GqaShape::gqa(4, 4, 128), 16, {70, 16}, 2, 1000});      // wider than all
}

TYPED_TEST(DecodeWindow, SplitAcrossThreads) {
  using Isa = typename TypeParam::type;
  kvattn::ThreadPool pool(3);
  // Chunks of 100 tokens: most lie wholly outside the window and must contribute nothing.
  decode_check::check_all_storage<Window, Isa>(Case{GqaShape::gqa(8, 1, 64), 7, {1500, 3}, 1, 150, 0, 100}, pool);
}

}  // namespace
