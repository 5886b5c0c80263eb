// tests/decode_check.hpp — one decode case run and checked against the reference, for the
// decode test's translation units: test_decode.cpp (the plain operator) and one file per
// compile-time variant (test_decode_window.cpp, test_decode_soft_cap.cpp,
// test_decode_window_soft_cap.cpp). Each variant instantiates the kernels of every storage type,
// head size and ISA again, so each has a translation unit of its own and they compile in parallel.
// The bounds are stated at the top of test_decode.cpp.
#pragma once

#include <kvattn/decode.hpp>

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "attention_checks.hpp"

namespace decode_check {

using Case = checks::DecodeCase;

/// Runs decode<V> on the case through `pf` (DecodeParams::threads = threads) and checks it. The
/// case's window and soft-cap must be the ones V compiles in: a case with a window run by a
/// variant without one would test nothing of the window.
template <class V, class T, class Isa, class PF>
void check(const Case& c, PF&& pf, int threads) {
  SCOPED_TRACE(describe(c) + " storage=" + std::string(kvattn::storage_traits<T>::name) + " isa=" + std::string(Isa::name));
  ASSERT_EQ(c.window > 0, V::sliding_window) << "the case's window does not match the variant";
  ASSERT_EQ(c.soft_cap > 0, V::soft_cap) << "the case's soft-cap does not match the variant";
  const checks::DecodeInputs<T> in(c);
  std::vector<float> out = in.out(), lse = in.lse(c);
  const kvattn::BatchPageTable table = in.cache.page_table(in.seqs);
  const kvattn::DecodeParams p = checks::decode_params(c, threads);
  kvattn::DecodeWorkspace ws;
  kvattn::decode<V>(in.cache.view(table, 0), c.shape, in.q.data(), out.data(), lse.data(), p, ws, pf, Isa{});
  checks::expect_decode_case_matches(in, c, out, lse);
}

/// check for fp32, fp16 and bf16 storage.
template <class V, class Isa, class PF = kvattn::SerialFor>
void check_all_storage(const Case& c, PF&& pf = PF{}, int threads = 1) {
  check<V, float, Isa>(c, pf, threads);
  check<V, kvattn::fp16, Isa>(c, pf, threads);
  check<V, kvattn::bf16, Isa>(c, pf, threads);
}

/// The ISAs every decode test runs, as gtest type parameters: the scalar path and the native one.
template <class Isa> struct IsaTag {
  using type = Isa;
};
using Isas = ::testing::Types<IsaTag<kvattn::isa::scalar>, IsaTag<kvattn::isa::native>>;

}  // namespace decode_check
