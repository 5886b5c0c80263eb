// Rotary position embedding against a plain double-precision reference written here (its own
// frequencies, angles and pairing; none of rope.hpp's math), for both styles (neox rotate-half,
// gptj interleaved); whole-head and partial rotary widths (head 128 rotating 64, head 7 rotating
// 4, head 600 rotating 520: more pairs than one block of the kernel); head sizes 2, 6, 64, 80,
// 128, 256, 512; bases 10000 and 500000; positions 0, 1, 4095, 131071, 1000000 and random ones
// up to 2^21; 1 and 8 heads; 1 and 37 tokens; the scalar path and the native SIMD path.
//
// Bound, element-wise, for the pair (a, b) of the input that an element belongs to:
//   |got − ref| <= kBound · (|a| + |b|),  kBound = 4 · 2^-24 ≈ 2.4e-7,
// the same at every position: the kernel forms angles in double, so only the rounding of cos and
// sin to fp32 and the fp32 rotation remain, about 3 roundings (2^-24 each, relative) of values
// no larger than |a| + |b|. Measured worst case: 2.2 · 2^-24 (the test prints it). Pass-through
// elements of a partial rotary width, and every element at position 0, must be bit-identical.
#include <kvattn/rope.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "isa_tags.hpp"
#include "rope_reference.hpp"

namespace {

using kvattn::RopeConfig;
using kvattn::RopeStyle;

constexpr double kBound = reference::kRopeBound;  // 4 · 2^-24

// The reference: rope_reference.hpp.
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

std::string describe(const RopeConfig& c) {
  return kvattn::detail::concat("style=", kvattn::to_string(c.style), " head_dim=", c.head_dim,
                                " rotary_dim=", c.rotary_dim, " base=", c.base);
}

using isa_tags::Isas;
template <class P> class RopeKernel : public ::testing::Test {};
TYPED_TEST_SUITE(RopeKernel, Isas);

/// Rotates random heads with apply_rope<Isa> and compares with the reference; returns the largest
/// |got − ref| / (|a| + |b|) seen.
template <class Isa>
double check(const RopeConfig& c, int heads, const std::vector<std::int64_t>& positions, unsigned seed) {
  const std::int64_t tokens = static_cast<std::int64_t>(positions.size());
  std::string trace = describe(c) + " heads=" + std::to_string(heads) + " isa=" + std::string(Isa::name) + " positions=";
  for (auto p : positions) trace += std::to_string(p) + ",";
  SCOPED_TRACE(trace);
  const int D = c.head_dim, R = c.rotary_dim == 0 ? c.head_dim : c.rotary_dim;
  const std::vector<float> x = random_vector(static_cast<std::size_t>(tokens * heads * D), seed);
  std::vector<float> got = x;
  const kvattn::Rope rope(c);
  kvattn::apply_rope(rope, got.data(), tokens, heads, positions.data(), Isa{});
  const std::vector<double> ref = reference_rope(c.style, D, c.rotary_dim, c.base, x, tokens, heads, positions);

  double worst = 0.0;
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
        const double scale = pair_scale(c.style, R, x.data() + off, j);
        const double err = std::abs(static_cast<double>(got[e]) - ref[e]);
        if (scale > 0) worst = std::max(worst, err / scale);
        if (!(err <= kBound * scale) && reported++ < 5)
          ADD_FAILURE() << "t=" << t << " h=" << h << " j=" << j << ": got " << got[e] << ", reference " << ref[e]
                        << ", error " << err << ", bound " << kBound * scale;
      }
    }
  return worst;
}

struct Widths {
  int head_dim, rotary_dim;
};
// Whole heads (rotary_dim 0) and partial ones; half-widths 1, 3, 2, 32, 40, 64, 128, 256, 260
// cover SIMD tails, exact multiples of the vector width and several blocks of frequencies.
const Widths kWidths[] = {{2, 0}, {6, 0}, {7, 4}, {64, 0}, {80, 0}, {128, 0}, {128, 64},
                          {256, 0}, {512, 0}, {600, 520}};
const std::int64_t kPositions[] = {0, 1, 4095, 131071, 1000000};

TYPED_TEST(RopeKernel, MatchesReferenceOverShapesPositionsAndBases) {
  using Isa = typename TypeParam::type;
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::int64_t> any_pos(0, std::int64_t{1} << 21);
  double worst = 0.0;
  unsigned seed = 1;
  for (RopeStyle style : {RopeStyle::neox, RopeStyle::gptj})
    for (const Widths& w : kWidths)
      for (double base : {10000.0, 500000.0}) {
        const RopeConfig c{style, w.head_dim, w.rotary_dim, base};
        for (int heads : {1, 8}) {
          for (std::int64_t p : kPositions) worst = std::max(worst, check<Isa>(c, heads, {p}, seed++));
          std::vector<std::int64_t> many;  // 37 tokens: every listed position, then random ones
          for (std::int64_t p : kPositions) many.push_back(p);
          while (many.size() < 37) many.push_back(any_pos(rng));
          std::shuffle(many.begin(), many.end(), rng);
          worst = std::max(worst, check<Isa>(c, heads, many, seed++));
        }
      }
  std::printf("isa %s: worst |got - ref| / (|a| + |b|) = %.3g = %.2f * 2^-24 (bound %.2f * 2^-24)\n", Isa::name.data(),
              worst, worst * 16777216.0, kBound * 16777216.0);
}

TYPED_TEST(RopeKernel, PositionZeroIsTheIdentity) {
  using Isa = typename TypeParam::type;
  for (RopeStyle style : {RopeStyle::neox, RopeStyle::gptj})
    for (const Widths& w : kWidths) {
      const kvattn::Rope rope(RopeConfig{style, w.head_dim, w.rotary_dim, 500000.0});
      const std::vector<float> x = random_vector(static_cast<std::size_t>(3 * 5 * w.head_dim), 11);
      std::vector<float> got = x;
      const std::vector<std::int64_t> zeros(3, 0);
      kvattn::apply_rope(rope, got.data(), 3, 5, zeros.data(), Isa{});
      EXPECT_EQ(0, std::memcmp(got.data(), x.data(), x.size() * sizeof(float))) << describe(rope.config());
    }
}

TYPED_TEST(RopeKernel, PreservesPairNorms) {
  using Isa = typename TypeParam::type;
  for (RopeStyle style : {RopeStyle::neox, RopeStyle::gptj})
    for (const Widths& w : {Widths{128, 0}, Widths{128, 64}, Widths{6, 0}, Widths{600, 520}}) {
      const RopeConfig c{style, w.head_dim, w.rotary_dim, 10000.0};
      SCOPED_TRACE(describe(c));
      const kvattn::Rope rope(c);
      const int D = w.head_dim, R = rope.rotary_dim();
      const std::vector<std::int64_t> positions = {1, 2, 77, 4095, 131071, 1000000, 123456789, -1000000};
      const std::int64_t tokens = static_cast<std::int64_t>(positions.size());
      const int heads = 4;
      const std::vector<float> x = random_vector(static_cast<std::size_t>(tokens * heads * D), 5);
      std::vector<float> got = x;
      kvattn::apply_rope(rope, got.data(), tokens, heads, positions.data(), Isa{});
      int reported = 0;
      for (std::int64_t th = 0; th < tokens * heads; ++th)
        for (int i = 0; i < R / 2; ++i) {
          int f, s;
          pair_members(style, R, i, f, s);
          const float* in = x.data() + th * D;
          const float* out = got.data() + th * D;
          const double before = std::hypot(double{in[f]}, double{in[s]});
          const double after = std::hypot(double{out[f]}, double{out[s]});
          // Each element is within kBound·(|a| + |b|) of the exact rotation, which keeps the norm.
          const double bound = 2 * kBound * (std::abs(double{in[f]}) + std::abs(double{in[s]}));
          if (!(std::abs(after - before) <= bound) && reported++ < 5)
            ADD_FAILURE() << "token·head " << th << " pair " << i << ": norm " << before << " became " << after;
        }
    }
}

TYPED_TEST(RopeKernel, ScoresDependOnlyOnRelativePosition) {
  using Isa = typename TypeParam::type;
  // (m, n) pairs with the same m − n give the same q·k; n = 0 leaves k as it is.
  struct Pair {
    std::int64_t m, n;
  };
  const std::vector<std::vector<Pair>> families = {
      {{2, 0}, {5, 3}, {4097, 4095}, {131073, 131071}, {1000002, 1000000}},
      {{1000000, 0}, {1000007, 7}, {1131071, 131071}, {2000000, 1000000}},
      {{0, 4095}, {1, 4096}, {995905, 1000000}},  // negative offsets
  };
  for (RopeStyle style : {RopeStyle::neox, RopeStyle::gptj})
    for (const Widths& w : {Widths{128, 0}, Widths{128, 64}, Widths{64, 0}})
      for (double base : {10000.0, 500000.0}) {
        const RopeConfig c{style, w.head_dim, w.rotary_dim, base};
        SCOPED_TRACE(describe(c));
        const kvattn::Rope rope(c);
        const int D = w.head_dim, R = rope.rotary_dim(), heads = 4;
        const std::vector<float> q0 = random_vector(static_cast<std::size_t>(heads * D), 21);
        const std::vector<float> k0 = random_vector(static_cast<std::size_t>(heads * D), 22);
        for (const auto& family : families) {
          std::vector<double> first(heads);
          for (std::size_t f = 0; f < family.size(); ++f) {
            std::vector<float> q = q0, k = k0;
            kvattn::apply_rope(rope, q.data(), 1, heads, &family[f].m, Isa{});
            kvattn::apply_rope(rope, k.data(), 1, heads, &family[f].n, Isa{});
            for (int h = 0; h < heads; ++h) {
              double dot = 0, bound = 0;
              for (int j = 0; j < D; ++j) dot += double{q[static_cast<std::size_t>(h * D + j)]} * k[static_cast<std::size_t>(h * D + j)];
              // Two dot products, each off by at most 4·kBound·Σ_pairs (|q_a|+|q_b|)(|k_a|+|k_b|).
              for (int i = 0; i < R / 2; ++i) {
                const int j = style == RopeStyle::neox ? i : 2 * i;  // an element of pair i
                bound += 8.1 * kBound * pair_scale(style, R, q0.data() + h * D, j) * pair_scale(style, R, k0.data() + h * D, j);
              }
              if (f == 0) {
                first[static_cast<std::size_t>(h)] = dot;
              } else {
                EXPECT_NEAR(dot, first[static_cast<std::size_t>(h)], bound)
                    << "h=" << h << " m=" << family[f].m << " n=" << family[f].n << " against m=" << family[0].m
                    << " n=" << family[0].n;
              }
            }
          }
        }
      }
}

TYPED_TEST(RopeKernel, NegativePositionUndoesPositive) {
  using Isa = typename TypeParam::type;
  for (RopeStyle style : {RopeStyle::neox, RopeStyle::gptj}) {
    const kvattn::Rope rope(RopeConfig{style, 128, 96, 500000.0});
    const std::vector<std::int64_t> forward = {3, 4095, 1000000}, backward = {-3, -4095, -1000000};
    const std::vector<float> x = random_vector(3 * 2 * 128, 9);
    std::vector<float> y = x;
    kvattn::apply_rope(rope, y.data(), 3, 2, forward.data(), Isa{});
    kvattn::apply_rope(rope, y.data(), 3, 2, backward.data(), Isa{});
    for (std::size_t e = 0; e < x.size(); ++e) {
      const double bound = 3 * kBound * pair_scale(style, 96, x.data() + e / 128 * 128, static_cast<int>(e % 128));
      ASSERT_NEAR(y[e], x[e], bound) << "style=" << kvattn::to_string(style) << " element " << e;
    }
  }
}

TYPED_TEST(RopeKernel, NothingToDoTouchesNothing) {
  using Isa = typename TypeParam::type;
  const kvattn::Rope rope(RopeConfig{RopeStyle::neox, 64, 0, 10000.0});
  kvattn::apply_rope(rope, nullptr, 0, 8, nullptr, Isa{});
  std::vector<float> x = random_vector(64, 3);
  const std::vector<float> before = x;
  const std::int64_t pos = 5;
  kvattn::apply_rope(rope, x.data(), 1, 0, &pos, Isa{});
  kvattn::apply_rope(rope, x.data(), -1, 1, &pos, Isa{});
  EXPECT_EQ(x, before);
}

TEST(RopeKernelDefaultIsa, IsTheNativeOne) {
  const kvattn::Rope rope(RopeConfig{RopeStyle::gptj, 64, 32, 10000.0});
  const std::vector<std::int64_t> positions = {0, 17, 1000000};
  std::vector<float> a = random_vector(3 * 2 * 64, 4), b = a;
  kvattn::apply_rope(rope, a.data(), 3, 2, positions.data());
  kvattn::apply_rope(rope, b.data(), 3, 2, positions.data(), kvattn::isa::native{});
  EXPECT_EQ(a, b);
}

// --- Configuration and its errors. -------------------------------------------------------------

TEST(RopeConfig, AccessorsAndFrequencies) {
  const kvattn::Rope whole(RopeConfig{RopeStyle::gptj, 128, 0, 500000.0});
  EXPECT_EQ(whole.config().rotary_dim, 0);  // as given
  EXPECT_EQ(whole.rotary_dim(), 128);       // resolved
  EXPECT_EQ(whole.head_dim(), 128);
  EXPECT_EQ(whole.style(), RopeStyle::gptj);
  EXPECT_EQ(whole.inv_freq()[0], 1.0);
  EXPECT_NEAR(whole.inv_freq()[63], std::exp(-std::log(500000.0) * 126.0 / 128.0), 1e-15);
  const kvattn::Rope partial(RopeConfig{RopeStyle::neox, 128, 64, 10000.0});
  EXPECT_EQ(partial.rotary_dim(), 64);
  EXPECT_NEAR(partial.inv_freq()[31], std::exp(-std::log(10000.0) * 62.0 / 64.0), 1e-15);
  const RopeConfig defaults{};
  EXPECT_EQ(defaults.style, RopeStyle::neox);
  EXPECT_EQ(defaults.base, 10000.0);
  EXPECT_EQ(kvattn::to_string(RopeStyle::neox), "neox");
  EXPECT_EQ(kvattn::to_string(RopeStyle::gptj), "gptj");
  EXPECT_EQ((RopeConfig{RopeStyle::neox, 7, 6, 10000.0}.check()), "");  // odd head, even rotary width
  EXPECT_EQ((RopeConfig{RopeStyle::gptj, 2, 2, 1.0}.check()), "");
}

/// The message of the kvattn::invalid_argument that constructing a Rope from `c` throws.
std::string error_of(const RopeConfig& c) {
  EXPECT_FALSE(c.check().empty()) << describe(c);
  try {
    const kvattn::Rope rope(c);
  } catch (const kvattn::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "RopeConfig " + c.check());
    return e.what();
  }
  ADD_FAILURE() << describe(c) << ": no exception";
  return {};
}

TEST(RopeConfig, EveryErrorNamesItsValues) {
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  EXPECT_EQ(error_of({RopeStyle::neox, 0, 0, 10000.0}), "RopeConfig head_dim=0: must be positive");
  EXPECT_EQ(error_of({RopeStyle::neox, -64, 0, 10000.0}), "RopeConfig head_dim=-64: must be positive");
  EXPECT_EQ(error_of({RopeStyle::gptj, 128, 130, 10000.0}),
            "RopeConfig rotary_dim=130 head_dim=128: rotary_dim must not exceed head_dim");
  EXPECT_EQ(error_of({RopeStyle::neox, 128, 63, 10000.0}), "RopeConfig rotary_dim=63: must be even (it rotates pairs)");
  EXPECT_EQ(error_of({RopeStyle::neox, 63, 0, 10000.0}),
            "RopeConfig rotary_dim=0 head_dim=63: the rotated width (head_dim when rotary_dim=0) must be even");
  EXPECT_EQ(error_of({RopeStyle::neox, 64, -2, 10000.0}), "RopeConfig rotary_dim=-2: must be >= 0 (0: head_dim)");
  EXPECT_EQ(error_of({RopeStyle::neox, 64, 0, 0.0}), "RopeConfig base=0: must be positive and finite");
  EXPECT_EQ(error_of({RopeStyle::neox, 64, 0, -500000.0}), "RopeConfig base=-500000: must be positive and finite");
  EXPECT_EQ(error_of({RopeStyle::neox, 64, 0, nan}), "RopeConfig base=nan: must be positive and finite");
  EXPECT_EQ(error_of({RopeStyle::neox, 64, 0, inf}), "RopeConfig base=inf: must be positive and finite");
  EXPECT_EQ(error_of({static_cast<RopeStyle>(7), 64, 0, 10000.0}),
            "RopeConfig style=7: must be RopeStyle::neox or RopeStyle::gptj");
  // The error is a std::invalid_argument too, and validate() throws the same.
  EXPECT_THROW(kvattn::Rope(RopeConfig{RopeStyle::neox, 64, 65, 10000.0}), std::invalid_argument);
  EXPECT_THROW((RopeConfig{RopeStyle::neox, 64, 65, 10000.0}.validate()), kvattn::invalid_argument);
}

}  // namespace
