// tests/decode_check.hpp — one decode case run and checked against the reference, for the
// decode test's translation units: test_decode.cpp (the plain operator) and one file per group of
// score policies (test_decode_window.cpp, test_decode_soft_cap.cpp, ...), compiled as one unit
// (tests/CMakeLists.txt). The bounds are stated at the top of test_decode.cpp.
#pragma once

#include <kvattn/decode.hpp>

#include <gtest/gtest.h>

#include <string>
#include <type_traits>
#include <vector>

#include "attention_checks.hpp"
#include "isa_tags.hpp"
#include "policy_checks.hpp"

namespace decode_check {

using Case = checks::DecodeCase;

/// Runs decode with policy P (its values from the case: policy_values) through `pf`, the plan
/// made for that parallel-for's threads, and checks it against the reference.
template <class P, class T, class Isa, class PF>
void check(const Case& c, PF&& pf) {
  SCOPED_TRACE(describe(c) + " storage=" + std::string(kvattn::format_traits<T>::name) + " isa=" + std::string(Isa::name));
  checks::check_decode_case<T, P>(c, pf, [](const auto& kv, const float* q, float* out, float* lse, kvattn::DecodePlan& plan,
                                            auto& parallel_for, const P& policy) {
    kvattn::decode(kv, q, out, lse, plan, parallel_for, policy, Isa{});
  });
}

/// check for fp32, fp16 and bf16 storage, and on the native ISA also int8_row, fp8_e4m3_row and,
/// for the plain operator, fp8_e4m3_layer (its scales are folded into the softmax scale and the
/// output, outside the score policies' hooks), for head sizes that are powers of two
/// hadamard<int8_row> (the rotation, likewise) and for head sizes that are whole blocks of 32
/// q4_block (its blocks' scales are applied as a row is loaded, before the scores the policies
/// see); the quantized formats against the reference on the cache's dequantized keys and values,
/// which read() returns, so within the same bounds. The quantized formats' kernels are the 16-bit
/// ones' with another load and a scale per token (per block): what their portable path adds is
/// checked where it is the native one (the scalar preset) and by test_int8_queries, and every
/// policy's kernels on each x86 ISA by test_x86_isas.
template <class P, class Isa, class PF = kvattn::SerialFor>
void check_all_storage(const Case& c, PF&& pf = PF{}) {
  check<P, float, Isa>(c, pf);
  check<P, kvattn::fp16, Isa>(c, pf);
  check<P, kvattn::bf16, Isa>(c, pf);
  if constexpr (std::is_same_v<Isa, kvattn::isa::native>) {
    check<P, kvattn::int8_row, Isa>(c, pf);
    check<P, kvattn::fp8_e4m3_row, Isa>(c, pf);
    if constexpr (std::is_same_v<P, kvattn::Plain>) {
      check<P, kvattn::fp8_e4m3_layer, Isa>(c, pf);
      if ((c.shape.head_dim & (c.shape.head_dim - 1)) == 0) check<P, kvattn::hadamard<kvattn::int8_row>, Isa>(c, pf);
      if (c.shape.head_dim % 32 == 0) check<P, kvattn::q4_block, Isa>(c, pf);
    }
  }
}

/// The ISAs every decode test runs, as gtest type parameters (isa_tags.hpp).
using isa_tags::IsaTag;
using isa_tags::Isas;

}  // namespace decode_check
