// kvattn/rope.hpp — rotary position embedding (RoPE), applied in place to queries and keys.
//
// RoPE turns a head vector x at position p into R(p)·x, where R(p) rotates pairs of elements:
// pair i (i < rotary_dim / 2) by the angle p · inv_freq[i], inv_freq[i] = base^(-2i / rotary_dim):
//   (a, b) -> (a·cos − b·sin, a·sin + b·cos).
// Because R(m)ᵀR(n) = R(n − m), the score R(m)q · R(n)k depends on positions only through n − m.
// Two conventions pair the elements differently (RopeStyle):
//   neox: "rotate-half", pair i is (x[i], x[i + rotary_dim/2]);
//   gptj: "interleaved", pair i is (x[2i], x[2i + 1]).
// Partial rotary (rotary_dim < head_dim): only the first rotary_dim elements of each head rotate,
// paired as above within that width; elements [rotary_dim, head_dim) pass through untouched.
//
// Numerics: angles are formed in double (p · inv_freq[i]) and their cosine and sine taken in
// double, then rounded to float; only the rotation itself is fp32. So a rotated element is
// within about 3 · 2^-24 · (|a| + |b|) of the exact rotation of the same inputs (a, b) at
// any position, including p ~ 10^6 where an fp32 angle would already be off by ~0.03 rad.
// (Frameworks that form angles in fp32 differ from this, and from the exact rotation, by their
// own rounding at large positions.) Cosine and sine are computed once per (token, pair) and
// reused by every head of the token.
//
//   x          [tokens][heads][head_dim]  fp32, rotated in place
//   positions  [tokens]                   the position of every head of token t
#pragma once

#include <cmath>
#include <cstdint>

#include "config.hpp"
#include "error.hpp"
#include "rope_config.hpp"
#include "simd.hpp"

namespace kvattn {


KVATTN_BEGIN_TARGET_NAMESPACE
namespace rope_impl {  // (not "detail": that name is kvattn::detail's)

/// Pairs whose cosine and sine are held at once (on the stack): 128 covers rotary_dim <= 256 in
/// one block; wider heads are rotated block by block.
inline constexpr int kRopeBlock = 128;

/// Rotate-half pairs [i0, i0 + n) of one head: lo = x + i0, hi = x + rotary_dim/2 + i0.
template <class Isa>
KVATTN_ALWAYS_INLINE void rotate_neox(float* KVATTN_RESTRICT lo, float* KVATTN_RESTRICT hi, const float* cs,
                                      const float* sn, int n) noexcept {
  using Vec = simd::Vec<Isa>;
  constexpr int W = Vec::lanes;
  int j = 0;
  for (; j + W <= n; j += W) {
    const Vec a = Vec::load(lo + j), b = Vec::load(hi + j);
    const Vec c = Vec::load(cs + j), s = Vec::load(sn + j);
    fma(a, c, Vec::zero() - b * s).store(lo + j);  // a·cos − b·sin
    fma(a, s, b * c).store(hi + j);                // a·sin + b·cos
  }
  if (j < n) {
    const int r = n - j;
    const Vec a = Vec::load_partial(lo + j, r), b = Vec::load_partial(hi + j, r);
    const Vec c = Vec::load_partial(cs + j, r), s = Vec::load_partial(sn + j, r);
    fma(a, c, Vec::zero() - b * s).store_partial(lo + j, r);
    fma(a, s, b * c).store_partial(hi + j, r);
  }
}

/// Interleaved pairs [i0, i0 + n) of one head: p = x + 2·i0 holds (a0, b0, a1, b1, ...).
KVATTN_ALWAYS_INLINE void rotate_gptj(float* KVATTN_RESTRICT p, const float* cs, const float* sn, int n) noexcept {
  for (int j = 0; j < n; ++j) {
    const float a = p[2 * j], b = p[2 * j + 1];
    p[2 * j] = a * cs[j] - b * sn[j];
    p[2 * j + 1] = a * sn[j] + b * cs[j];
  }
}

}  // namespace rope_impl

/// Rotates every head of every token in place: head h of token t, x[t][h][0 .. head_dim), by
/// the rotation of position positions[t] (see the top of this file).
///   x          [tokens][heads][rope.head_dim()]  fp32, in place
///   positions  [tokens]                          any value; negative ones rotate backwards.
///                                                The double angle is off by at most
///                                                ~|p|·2^-51 rad (5e-10 at p = 10^6)
/// Elements [rope.rotary_dim(), head_dim) of each head are not written. Nothing is done when
/// tokens <= 0 or heads <= 0 (x and positions may then be null). Allocates nothing and never
/// throws; disjoint ranges of tokens may be rotated concurrently by separate calls.
template <class IsaTag = isa::native>
void apply_rope(const Rope& rope, float* x, std::int64_t tokens, int heads, const std::int64_t* positions,
                IsaTag = IsaTag{}) noexcept {
  using Isa = compiled_isa_t<IsaTag>;  // the tag, or its nearest base this unit compiles
  if (tokens <= 0 || heads <= 0) return;
  const int D = rope.head_dim(), half = rope.rotary_dim() / 2;
  const bool neox = rope.style() == RopeStyle::neox;
  const double* inv_freq = rope.inv_freq();
  const std::int64_t token_stride = std::int64_t{heads} * D;
  float cs[rope_impl::kRopeBlock], sn[rope_impl::kRopeBlock];
  for (std::int64_t t = 0; t < tokens; ++t) {
    const double pos = static_cast<double>(positions[t]);
    float* xt = x + t * token_stride;
    for (int i0 = 0; i0 < half; i0 += rope_impl::kRopeBlock) {
      const int n = half - i0 < rope_impl::kRopeBlock ? half - i0 : rope_impl::kRopeBlock;
      for (int j = 0; j < n; ++j) {
        const double angle = pos * inv_freq[i0 + j];
        cs[j] = static_cast<float>(std::cos(angle));
        sn[j] = static_cast<float>(std::sin(angle));
      }
      for (int h = 0; h < heads; ++h) {
        float* xh = xt + std::int64_t{h} * D;
        if (neox)
          rope_impl::rotate_neox<Isa>(xh + i0, xh + half + i0, cs, sn, n);
        else
          rope_impl::rotate_gptj(xh + 2 * i0, cs, sn, n);
      }
    }
  }
}

KVATTN_END_TARGET_NAMESPACE
}  // namespace kvattn
