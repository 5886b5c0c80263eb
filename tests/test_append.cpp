// Rotary position embedding where tokens enter the cache: write_kv (keys rotated at their
// positions on the way in), rotate_decode_queries (decode's queries at their positions), and
// prefill with PrefillParams::rope. Against a plain double-precision reference written here: it
// rotates the raw queries and keys itself (its own frequencies, angles in double and pairing;
// none of rope.hpp's math) and attends in double.
//
// Covered: both styles (neox rotate-half, gptj interleaved); bases 10000 and 500000; whole and
// partial rotary widths; head sizes 64, 80, 128; group sizes 1, 3, 4; page sizes 1, 7, 16;
// contexts 0, 1, 50, 300 and 1000 before the last chunk; a batch whose sequences sit at
// different positions; several chunkings against one-shot prefill; decode (1 and 3 queries per
// sequence) after write_kv against prefill's last rows; write_kv against apply_rope, bit for bit;
// the callers' arrays left alone; errors that must leave the cache exactly as it was; fp32, fp16
// and bf16 storage; the scalar and the native path.
//
// Bounds. Attention outputs use test_prefill.cpp's element-wise bounds unchanged:
//   |out − ref| <= (2e-5 + 2·e_s) · max|v| + 2e-5 · |ref|,  |lse − ref| <= 2e-5 · (1 + |ref|) + e_s,
// e_s = 2^-23 · scale · head_dim · max|q| · max|k| (the rounding of one fp32 score).
// The cached keys, element-wise against the exact rotation r of the raw key pair (a, b):
//   |stored − r| <= u_T · (|r| + e) + e + tiny_T,  e = 4 · 2^-24 · (|a| + |b|)
// (e: the fp32 rotation, as in test_rope.cpp; u_T: the unit roundoff of the storage, 0 for fp32,
// 2^-11 for fp16, 2^-8 for bf16; tiny_T: half the spacing of fp16's subnormals, 2^-25).
// The reference attends with exactly rotated keys for fp32 storage, and with the cached keys
// (checked by the bound above) for fp16 and bf16, whose rounding of a key it cannot repeat on
// its own: the exact rotation and the kernel's fp32 one can round to neighbouring values.
#include <kvattn/append.hpp>
#include <kvattn/decode.hpp>
#include <kvattn/prefill.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "attention_checks.hpp"
#include "cache_snapshot.hpp"
#include "isa_tags.hpp"
#include "rope_reference.hpp"

namespace {

using kvattn::GqaShape;
using kvattn::RopeConfig;
using kvattn::RopeStyle;

using reference::kRopeBound;

// --- The reference: double precision, written from the definition (RoPE: rope_reference.hpp). ---

/// x [tokens][heads][D], token t rotated exactly at position first + t.
std::vector<double> rotate_exact(const RopeConfig& c, const float* x, std::int64_t tokens, int heads, std::int64_t first) {
  std::vector<std::int64_t> positions(static_cast<std::size_t>(tokens));
  for (std::int64_t t = 0; t < tokens; ++t) positions[static_cast<std::size_t>(t)] = first + t;
  return reference::rope(c.style, c.head_dim, c.rotary_dim, c.base, x, tokens, heads, positions.data());
}

/// |a| + |b| of the pair element j of a head belongs to (0 for elements that do not rotate).
double pair_scale(const RopeConfig& c, const float* head, int j) {
  return reference::pair_scale(c.style, c.rotary_dim == 0 ? c.head_dim : c.rotary_dim, head, j);
}

/// Causal attention of one sequence: queries [Q][q_heads][D] at positions L − Q + i over
/// keys and values [L][kv_heads][D]; out [Q][q_heads][D], lse [Q][q_heads].
void attend(const GqaShape& s, const std::vector<double>& q, int Q, const std::vector<double>& keys,
            const std::vector<double>& values, std::int64_t L, std::vector<double>& out, std::vector<double>& lse) {
  const int H = s.q_heads, G = s.kv_heads, D = s.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  out.assign(static_cast<std::size_t>(Q) * H * D, 0.0);
  lse.assign(static_cast<std::size_t>(Q) * H, -std::numeric_limits<double>::infinity());
  std::vector<double> score(static_cast<std::size_t>(L));
  for (int i = 0; i < Q; ++i)
    for (int h = 0; h < H; ++h) {
      const std::int64_t qpos = L - Q + i, g = s.kv_head_of(h);
      const double* qv = &q[static_cast<std::size_t>((std::int64_t{i} * H + h) * D)];
      double m = -std::numeric_limits<double>::infinity();
      for (std::int64_t t = 0; t <= qpos; ++t) {
        double dot = 0;
        for (int d = 0; d < D; ++d) dot += qv[d] * keys[static_cast<std::size_t>((t * G + g) * D + d)];
        score[static_cast<std::size_t>(t)] = dot * scale;
        m = std::max(m, dot * scale);
      }
      if (qpos < 0) continue;
      double sum = 0;
      double* o = &out[static_cast<std::size_t>((std::int64_t{i} * H + h) * D)];
      for (std::int64_t t = 0; t <= qpos; ++t) {
        const double w = std::exp(score[static_cast<std::size_t>(t)] - m);
        sum += w;
        for (int d = 0; d < D; ++d) o[d] += w * values[static_cast<std::size_t>((t * G + g) * D + d)];
      }
      for (int d = 0; d < D; ++d) o[d] /= sum;
      lse[static_cast<std::size_t>(i * H + h)] = m + std::log(sum);
    }
}

// --- Helpers. ----------------------------------------------------------------------------------

using checks::expect_close;
using checks::expect_lse_close;
using checks::expect_out_close;
using checks::Prompt;
using checks::random_prompt;

std::string describe(const RopeConfig& c) {
  return kvattn::detail::concat("rope style=", kvattn::to_string(c.style), " head_dim=", c.head_dim,
                                " rotary_dim=", c.rotary_dim, " base=", c.base);
}
std::string describe(const GqaShape& s) {
  return kvattn::detail::concat("q_heads=", s.q_heads, " kv_heads=", s.kv_heads, " head_dim=", s.head_dim);
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

/// Keys and values of tokens [0, length) of `seq` in `layer`, read back as fp32: [length][kv_heads][D] each.
template <class T>
void read_all(const kvattn::PagedKvCache<T>& cache, kvattn::SeqId seq, int layer, std::vector<float>& k, std::vector<float>& v) {
  const std::int64_t row = std::int64_t{cache.layout().kv_heads} * cache.layout().head_dim, L = cache.length(seq);
  k.assign(static_cast<std::size_t>(L * row), 0.0f);
  v.assign(k.size(), 0.0f);
  for (std::int64_t t = 0; t < L; ++t) cache.read(seq, layer, t, k.data() + t * row, v.data() + t * row);
}

/// x rounded to T and back.
template <class T> std::vector<float> rounded(const std::vector<float>& x) {
  std::vector<T> stored(x.size());
  std::vector<float> back(x.size());
  kvattn::convert_row(x.data(), stored.data(), x.size());
  kvattn::convert_row(stored.data(), back.data(), x.size());
  return back;
}

template <class T> constexpr double unit_roundoff() {
  return std::is_same_v<T, float> ? 0.0 : std::is_same_v<T, kvattn::fp16> ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
}

/// The cached keys of `seq` against the exact rotation of the raw keys k [L][kv_heads][D] (the
/// bound at the top), and the cached values against v rounded to T, bit for bit.
template <class T>
void expect_cached_keys_rotated(const kvattn::PagedKvCache<T>& cache, kvattn::SeqId seq, int layer, const RopeConfig& c,
                                const std::vector<float>& k, const std::vector<float>& v) {
  std::vector<float> got_k, got_v;
  read_all(cache, seq, layer, got_k, got_v);
  ASSERT_EQ(got_k.size(), k.size());
  const int G = cache.layout().kv_heads, D = cache.layout().head_dim;
  const std::int64_t L = cache.length(seq);
  const std::vector<double> exact = rotate_exact(c, k.data(), L, G, 0);
  const double u = unit_roundoff<T>(), tiny = std::is_same_v<T, kvattn::fp16> ? std::ldexp(1.0, -25) : 0.0;
  int bad = 0;
  for (std::int64_t th = 0; th < L * G; ++th)
    for (int j = 0; j < D; ++j) {
      const std::size_t e = static_cast<std::size_t>(th * D + j);
      const double rot_err = kRopeBound * pair_scale(c, k.data() + th * D, j);
      const double bound = u * (std::abs(exact[e]) + rot_err) + rot_err + tiny;
      if (!(std::abs(got_k[e] - exact[e]) <= bound) && bad++ < 5)
        ADD_FAILURE() << "cached key of token " << th / G << " head " << th % G << " element " << j << ": got " << got_k[e]
                      << ", exact rotation " << exact[e] << ", bound " << bound;
    }
  EXPECT_TRUE(same_bits(got_v, rounded<T>(v))) << "the cached values are not the values given";
}

/// e_s at the top: scale = 1/sqrt(head_dim), and the rotated queries and keys are at most sqrt 2
/// in magnitude (a rotated pair of elements in [-1, 1]), so max|q| · max|k| <= 2.
double score_error(const GqaShape& s) { return std::ldexp(1.0, -23) * std::sqrt(double(s.head_dim)) * 2.0; }


/// Prefills one sequence in the given chunks (each appended first); out and lse of every token.
template <class T, class Isa>
void run_chunks(kvattn::PagedKvCache<T>& cache, kvattn::SeqId seq, int layer, const GqaShape& s, const Prompt& pr,
                const std::vector<std::int64_t>& chunks, const kvattn::PrefillParams& params, std::vector<float>& out,
                std::vector<float>& lse) {
  std::int64_t total = 0;
  for (auto c : chunks) total += c;
  out.assign(static_cast<std::size_t>(total) * s.q_heads * s.head_dim, 7.0f);
  lse.assign(static_cast<std::size_t>(total) * s.q_heads, 7.0f);
  kvattn::PrefillPlan plan;
  kvattn::ThreadPool pool(2);
  std::int64_t done = 0;
  for (auto n : chunks) {
    cache.append(seq, n);
    plan.make(cache, {{seq, n}}, s, params, pool);
    const std::size_t qo = static_cast<std::size_t>(done) * s.q_heads * s.head_dim;
    const std::size_t kv = static_cast<std::size_t>(done) * s.kv_heads * s.head_dim;
    kvattn::prefill(cache, layer, pr.q.data() + qo, pr.k.data() + kv, pr.v.data() + kv, out.data() + qo,
                    lse.data() + static_cast<std::size_t>(done) * s.q_heads, plan, pool, kvattn::Plain{}, Isa{});
    done += n;
  }
}

using isa_tags::Isas;
template <class P> class RopeAppend : public ::testing::Test {};
TYPED_TEST_SUITE(RopeAppend, Isas);

// --- Prefill with RoPE against the reference. -------------------------------------------------

/// One sequence prefilled in `chunks` (the chunks before the last are its context) into `layer`
/// of a two-layer cache, against the reference over every token.
template <class T, class Isa>
void check_prefill(const RopeConfig& rc, const GqaShape& s, int page, const std::vector<std::int64_t>& chunks, int layer) {
  SCOPED_TRACE(describe(rc) + " " + describe(s) + kvattn::detail::concat(" page=", page, " storage=", kvattn::storage_traits<T>::name,
                                                                          " isa=", Isa::name, " layer=", layer, " chunks=", chunks.size(),
                                                                          " last=", chunks.back()));
  std::int64_t total = 0;
  for (auto c : chunks) total += c;
  kvattn::PagedKvCache<T> cache(kvattn::CacheConfig{2, page, (total + page - 1) / page + 1, s});
  const auto seq = cache.add_sequence();
  const Prompt pr = random_prompt(s, total, static_cast<unsigned>(total * 13 + s.head_dim + rc.rotary_dim));
  const Prompt given = pr;
  const kvattn::Rope rope(rc);
  kvattn::PrefillParams params;
  params.rope = &rope;
  std::vector<float> out, lse;
  run_chunks<T, Isa>(cache, seq, layer, s, pr, chunks, params, out, lse);
  EXPECT_TRUE(same_bits(pr.q, given.q) && same_bits(pr.k, given.k) && same_bits(pr.v, given.v))
      << "prefill changed the caller's q, k or v";

  expect_cached_keys_rotated(cache, seq, layer, rc, pr.k, pr.v);
  std::vector<float> other_k, other_v;  // the other layer was not written
  read_all(cache, seq, 1 - layer, other_k, other_v);
  for (float x : other_k) ASSERT_EQ(x, 0.0f) << "prefill wrote into layer " << 1 - layer;

  std::vector<float> cached_k, cached_v;
  read_all(cache, seq, layer, cached_k, cached_v);
  const std::vector<double> keys = std::is_same_v<T, float> ? rotate_exact(rc, pr.k.data(), total, s.kv_heads, 0)
                                                           : std::vector<double>(cached_k.begin(), cached_k.end());
  std::vector<double> ref, ref_lse;
  attend(s, rotate_exact(rc, pr.q.data(), total, s.q_heads, 0), static_cast<int>(total), keys,
         std::vector<double>(cached_v.begin(), cached_v.end()), total, ref, ref_lse);
  expect_out_close(out, ref, "out", score_error(s));
  expect_lse_close(lse, ref_lse, "lse", score_error(s));
}

TYPED_TEST(RopeAppend, PrefillMatchesReferenceOverStylesBasesAndShapes) {
  using Isa = typename TypeParam::type;
  for (RopeStyle style : {RopeStyle::neox, RopeStyle::gptj})
    for (double base : {10000.0, 500000.0}) {
      // Group 1, whole head, context 0.
      check_prefill<float, Isa>(RopeConfig{style, 64, 0, base}, GqaShape::gqa(4, 4, 64), 16, {45}, 0);
      // Group 3, head 80 rotating 32, context 1, pages of 7.
      check_prefill<kvattn::bf16, Isa>(RopeConfig{style, 80, 32, base}, GqaShape::gqa(6, 2, 80), 7, {1, 30}, 1);
      // Group 4, head 128 rotating 64, pages of one token, three chunks.
      check_prefill<kvattn::fp16, Isa>(RopeConfig{style, 128, 64, base}, GqaShape::gqa(8, 2, 128), 1, {20, 13, 17}, 0);
      // Group 1 (MHA), head 80 whole, fp32.
      check_prefill<float, Isa>(RopeConfig{style, 80, 0, base}, GqaShape::mha(3, 80), 7, {9, 24}, 1);
    }
}

TYPED_TEST(RopeAppend, PrefillWithLongContexts) {
  using Isa = typename TypeParam::type;
  check_prefill<kvattn::bf16, Isa>(RopeConfig{RopeStyle::neox, 128, 0, 500000.0}, GqaShape::gqa(8, 2, 128), 16, {300, 200}, 0);
  check_prefill<kvattn::fp16, Isa>(RopeConfig{RopeStyle::gptj, 64, 0, 10000.0}, GqaShape::gqa(4, 1, 64), 7, {1000, 24}, 1);
  check_prefill<float, Isa>(RopeConfig{RopeStyle::neox, 128, 96, 10000.0}, GqaShape::gqa(12, 4, 128), 16, {50, 250, 33}, 0);
}

TYPED_TEST(RopeAppend, ChunkingDoesNotChangeThePrefill) {
  using Isa = typename TypeParam::type;
  const GqaShape s = GqaShape::gqa(8, 2, 64);
  const RopeConfig rc{RopeStyle::gptj, 64, 48, 500000.0};
  const kvattn::Rope rope(rc);
  kvattn::PrefillParams params;
  params.rope = &rope;
  const Prompt pr = random_prompt(s, 120, 5);
  kvattn::PagedKvCache<kvattn::bf16> a(kvattn::CacheConfig{1, 16, 16, s});
  const auto sa = a.add_sequence();
  std::vector<float> one, one_lse, one_k, one_v;
  run_chunks<kvattn::bf16, Isa>(a, sa, 0, s, pr, {120}, params, one, one_lse);
  read_all(a, sa, 0, one_k, one_v);
  const std::vector<double> ref(one.begin(), one.end()), ref_lse(one_lse.begin(), one_lse.end());
  for (const std::vector<std::int64_t>& chunks : {std::vector<std::int64_t>{1, 119}, {60, 60}, {17, 33, 1, 69}, {119, 1}}) {
    SCOPED_TRACE(kvattn::detail::concat("chunks=", chunks.size(), " first=", chunks.front()));
    kvattn::PagedKvCache<kvattn::bf16> b(kvattn::CacheConfig{1, 7, 32, s});  // paged differently, too
    const auto sb = b.add_sequence();
    std::vector<float> out, lse, k, v;
    run_chunks<kvattn::bf16, Isa>(b, sb, 0, s, pr, chunks, params, out, lse);
    expect_out_close(out, ref, "chunked out");
    expect_lse_close(lse, ref_lse, "chunked lse");
    read_all(b, sb, 0, k, v);
    EXPECT_TRUE(same_bits(k, one_k) && same_bits(v, one_v)) << "the cached keys depend on the chunking";
  }
}

// --- Decode after write_kv, against prefill's last rows. --------------------------------------

/// Two sequences in one cache prefilled with RoPE (the second with a context of 53 tokens, then
/// both in one batched call, so their chunks sit at different positions); the same tokens
/// written with write_kv into a cache paged differently; decode with rotated queries of the last
/// Q tokens must give prefill's last Q rows.
template <class T, class Isa> void check_decode_after_write_kv(const RopeConfig& rc, const GqaShape& s) {
  SCOPED_TRACE(describe(rc) + " " + describe(s) + " storage=" + std::string(kvattn::storage_traits<T>::name));
  const kvattn::Rope rope(rc);
  const std::int64_t N[2] = {77, 130};
  const Prompt pr[2] = {random_prompt(s, N[0], 31), random_prompt(s, N[1], 32)};
  const std::int64_t qrow = std::int64_t{s.q_heads} * s.head_dim, krow = std::int64_t{s.kv_heads} * s.head_dim;

  // Prefill: sequence 1's first 53 tokens alone, then sequence 0's 77 and sequence 1's other 77 together.
  kvattn::PagedKvCache<T> a(kvattn::CacheConfig{1, 16, 20, s});
  const kvattn::SeqId sa[2] = {a.add_sequence(), a.add_sequence()};
  kvattn::PrefillParams params;
  params.rope = &rope;
  kvattn::PrefillPlan plan;
  std::vector<float> out[2], lse[2];
  for (int b = 0; b < 2; ++b) {
    out[b].assign(static_cast<std::size_t>(N[b] * qrow), 7.0f);
    lse[b].assign(static_cast<std::size_t>(N[b] * s.q_heads), 7.0f);
  }
  a.append(sa[1], 53);
  plan.make(a, {{sa[1], 53}}, s, params, 1);
  kvattn::prefill(a, 0, pr[1].q.data(), pr[1].k.data(), pr[1].v.data(), out[1].data(), lse[1].data(), plan, kvattn::SerialFor{},
                  kvattn::Plain{}, Isa{});
  a.append(sa[0], 77);
  a.append(sa[1], 77);
  std::vector<float> q(static_cast<std::size_t>(154 * qrow)), k(static_cast<std::size_t>(154 * krow)), v(k.size());
  std::vector<float> o(static_cast<std::size_t>(154 * qrow)), l(static_cast<std::size_t>(154 * s.q_heads));
  for (int b = 0; b < 2; ++b) {  // rows [77 b, 77 b + 77): the sequence's last 77 tokens
    const std::int64_t skip = N[b] - 77;
    std::copy(pr[b].q.begin() + skip * qrow, pr[b].q.end(), q.begin() + 77 * b * qrow);
    std::copy(pr[b].k.begin() + skip * krow, pr[b].k.end(), k.begin() + 77 * b * krow);
    std::copy(pr[b].v.begin() + skip * krow, pr[b].v.end(), v.begin() + 77 * b * krow);
  }
  kvattn::ThreadPool pool(2);
  plan.make(a, {{sa[0], 77}, {sa[1], 77}}, s, params, pool);
  kvattn::prefill(a, 0, q.data(), k.data(), v.data(), o.data(), l.data(), plan, pool, kvattn::Plain{}, Isa{});
  for (int b = 0; b < 2; ++b) {
    const std::int64_t skip = N[b] - 77;
    std::copy(o.begin() + 77 * b * qrow, o.begin() + 77 * (b + 1) * qrow, out[b].begin() + skip * qrow);
    std::copy(l.begin() + 77 * b * s.q_heads, l.begin() + 77 * (b + 1) * s.q_heads, lse[b].begin() + skip * s.q_heads);
  }
  for (int b = 0; b < 2; ++b) {  // the batched prefill against the reference, too
    SCOPED_TRACE(kvattn::detail::concat("prefill of sequence ", b));
    expect_cached_keys_rotated(a, sa[b], 0, rc, pr[b].k, pr[b].v);
    std::vector<float> ck, cv;
    read_all(a, sa[b], 0, ck, cv);
    std::vector<double> ref, ref_lse;
    attend(s, rotate_exact(rc, pr[b].q.data(), N[b], s.q_heads, 0), static_cast<int>(N[b]), std::vector<double>(ck.begin(), ck.end()),
           std::vector<double>(cv.begin(), cv.end()), N[b], ref, ref_lse);
    expect_out_close(out[b], ref, "prefill out", score_error(s));
    expect_lse_close(lse[b], ref_lse, "prefill lse", score_error(s));
  }

  // write_kv: every token, in two calls per sequence (the second of 3 tokens), into pages of 7.
  kvattn::PagedKvCache<T> c(kvattn::CacheConfig{1, 7, 40, s});
  const kvattn::SeqId sc[2] = {c.add_sequence(), c.add_sequence()};
  kvattn::AppendWorkspace aws;
  for (int b = 0; b < 2; ++b) {
    c.append(sc[b], N[b]);
    kvattn::write_kv(c, sc[b], 0, 0, N[b] - 3, pr[b].k.data(), pr[b].v.data(), &rope, aws, Isa{});
    kvattn::write_kv(c, sc[b], 0, N[b] - 3, 3, pr[b].k.data() + (N[b] - 3) * krow, pr[b].v.data() + (N[b] - 3) * krow, &rope,
                     aws, Isa{});
    std::vector<float> ka, va, kc, vc;
    read_all(a, sa[b], 0, ka, va);
    read_all(c, sc[b], 0, kc, vc);
    EXPECT_TRUE(same_bits(ka, kc) && same_bits(va, vc)) << "sequence " << b << ": write_kv and prefill cached different keys";
  }

  const kvattn::BatchPageTable table = c.page_table({sc[0], sc[1]});
  const kvattn::PagedKvView<T> view = c.view(table, 0);
  for (int Q : {1, 3}) {
    SCOPED_TRACE(kvattn::detail::concat("queries_per_seq=", Q));
    std::vector<float> dq(static_cast<std::size_t>(2 * Q * qrow));
    for (int b = 0; b < 2; ++b)
      std::copy(pr[b].q.end() - Q * qrow, pr[b].q.end(), dq.begin() + b * Q * qrow);
    kvattn::rotate_decode_queries(rope, view, dq.data(), Q, s.q_heads, Isa{});
    std::vector<float> dout(dq.size()), dlse(static_cast<std::size_t>(2 * Q * s.q_heads));
    kvattn::DecodeParams dp;
    dp.queries_per_seq = Q;
    kvattn::DecodePlan dplan;
    dplan.make(view, s, dp, 1);
    kvattn::decode(view, dq.data(), dout.data(), dlse.data(), dplan, kvattn::SerialFor{}, kvattn::Plain{}, Isa{});
    for (int b = 0; b < 2; ++b) {
      const std::vector<double> last(out[b].end() - Q * qrow, out[b].end());
      const std::vector<double> last_lse(lse[b].end() - Q * s.q_heads, lse[b].end());
      expect_out_close(std::vector<float>(dout.begin() + b * Q * qrow, dout.begin() + (b + 1) * Q * qrow), last,
                       kvattn::detail::concat("decode vs prefill, sequence ", b), score_error(s));
      expect_lse_close(std::vector<float>(dlse.begin() + b * Q * s.q_heads, dlse.begin() + (b + 1) * Q * s.q_heads), last_lse,
                       kvattn::detail::concat("decode lse vs prefill, sequence ", b), score_error(s));
    }
  }
}

TYPED_TEST(RopeAppend, DecodeAfterWriteKvEqualsPrefillsLastRows) {
  using Isa = typename TypeParam::type;
  check_decode_after_write_kv<kvattn::fp16, Isa>(RopeConfig{RopeStyle::neox, 128, 0, 10000.0}, GqaShape::gqa(8, 2, 128));
  check_decode_after_write_kv<kvattn::bf16, Isa>(RopeConfig{RopeStyle::gptj, 80, 64, 500000.0}, GqaShape::gqa(6, 2, 80));
  check_decode_after_write_kv<float, Isa>(RopeConfig{RopeStyle::neox, 64, 32, 500000.0}, GqaShape::mqa(3, 64));
}

// --- write_kv against apply_rope, bit for bit. ------------------------------------------------

template <class T, class Isa> void check_write_kv_bits(const RopeConfig& rc, int kv_heads, int page) {
  SCOPED_TRACE(describe(rc) + kvattn::detail::concat(" kv_heads=", kv_heads, " page=", page, " storage=",
                                                     kvattn::storage_traits<T>::name, " isa=", Isa::name));
  const GqaShape s = GqaShape::gqa(kv_heads, kv_heads, rc.head_dim);
  const std::int64_t L = 150, row = std::int64_t{kv_heads} * rc.head_dim;
  const kvattn::Rope rope(rc);
  const Prompt pr = random_prompt(s, L, 77);
  const Prompt given = pr;
  kvattn::PagedKvCache<T> a(kvattn::CacheConfig{2, page, (L + page - 1) / page + 1, s});
  kvattn::PagedKvCache<T> b(kvattn::CacheConfig{2, page, (L + page - 1) / page + 1, s});
  const auto sa = a.add_sequence(), sb = b.add_sequence();
  a.append(sa, L);
  b.append(sb, L);
  // Layer 1 with RoPE: tokens [0, 70) then [70, 150) (more than a block of 64 positions), one workspace.
  kvattn::AppendWorkspace ws;
  kvattn::write_kv(a, sa, 1, 0, 70, pr.k.data(), pr.v.data(), &rope, ws, Isa{});
  kvattn::write_kv(a, sa, 1, 70, 80, pr.k.data() + 70 * row, pr.v.data() + 70 * row, &rope, ws, Isa{});
  std::vector<float> rotated = pr.k;
  std::vector<std::int64_t> positions(static_cast<std::size_t>(L));
  for (std::int64_t t = 0; t < L; ++t) positions[static_cast<std::size_t>(t)] = t;
  kvattn::apply_rope(rope, rotated.data(), L, kv_heads, positions.data(), Isa{});
  b.write(sb, 1, 0, L, rotated.data(), pr.v.data());
  // Layer 0 without: the same as write().
  kvattn::write_kv(a, sa, 0, 0, L, pr.k.data(), pr.v.data(), nullptr, ws, Isa{});
  b.write(sb, 0, 0, L, pr.k.data(), pr.v.data());
  EXPECT_TRUE(same_bits(pr.k, given.k) && same_bits(pr.v, given.v)) << "write_kv changed the caller's k or v";
  for (int layer : {0, 1}) {
    std::vector<float> ka, va, kb, vb;
    read_all(a, sa, layer, ka, va);
    read_all(b, sb, layer, kb, vb);
    EXPECT_TRUE(same_bits(ka, kb)) << "layer " << layer << ": keys differ from apply_rope then write";
    EXPECT_TRUE(same_bits(va, vb)) << "layer " << layer << ": values differ";
  }
  expect_cached_keys_rotated(a, sa, 1, rc, pr.k, pr.v);
}

TYPED_TEST(RopeAppend, WriteKvMatchesApplyRopeBitForBit) {
  using Isa = typename TypeParam::type;
  for (int page : {1, 7, 16}) {
    check_write_kv_bits<float, Isa>(RopeConfig{RopeStyle::neox, 128, 0, 10000.0}, 2, page);
    check_write_kv_bits<kvattn::fp16, Isa>(RopeConfig{RopeStyle::gptj, 80, 32, 500000.0}, 3, page);
    check_write_kv_bits<kvattn::bf16, Isa>(RopeConfig{RopeStyle::neox, 64, 48, 500000.0}, 1, page);
  }
}

TYPED_TEST(RopeAppend, WriteKvIntoASharedPageCopiesIt) {
  using Isa = typename TypeParam::type;
  const GqaShape s = GqaShape::gqa(4, 2, 64);
  const kvattn::Rope rope(RopeConfig{RopeStyle::neox, 64, 0, 10000.0});
  kvattn::PagedKvCache<kvattn::bf16> cache(kvattn::CacheConfig{1, 4, 8, s});
  const auto parent = cache.add_sequence();
  cache.append(parent, 6);
  const Prompt pr = random_prompt(s, 6, 3), other = random_prompt(s, 6, 4);
  kvattn::AppendWorkspace ws;
  kvattn::write_kv(cache, parent, 0, 0, 6, pr.k.data(), pr.v.data(), &rope, ws, Isa{});
  std::vector<float> before_k, before_v;
  read_all(cache, parent, 0, before_k, before_v);
  const auto child = cache.fork(parent);
  kvattn::write_kv(cache, child, 0, 2, 3, other.k.data(), other.v.data(), &rope, ws, Isa{});  // both pages shared
  std::vector<float> after_k, after_v;
  read_all(cache, parent, 0, after_k, after_v);
  EXPECT_TRUE(same_bits(before_k, after_k) && same_bits(before_v, after_v)) << "the write went into the parent's pages";
  EXPECT_EQ(cache.stats().pages_shared, 0);
  cache.check_invariants();
  std::vector<float> ck, cv, expect_k = pr.k;
  std::copy(other.k.begin(), other.k.begin() + 3 * 2 * 64, expect_k.begin() + 2 * 2 * 64);
  std::vector<float> expect_v = pr.v;
  std::copy(other.v.begin(), other.v.begin() + 3 * 2 * 64, expect_v.begin() + 2 * 2 * 64);
  expect_cached_keys_rotated(cache, child, 0, rope.config(), expect_k, expect_v);
}

// --- rotate_decode_queries. --------------------------------------------------------------------

TYPED_TEST(RopeAppend, DecodeQueriesAreRotatedAtTheirPositions) {
  using Isa = typename TypeParam::type;
  const GqaShape s = GqaShape::gqa(6, 2, 80);
  const RopeConfig rc{RopeStyle::gptj, 80, 0, 500000.0};
  const kvattn::Rope rope(rc);
  kvattn::PagedKvCache<float> cache(kvattn::CacheConfig{1, 7, 64, s});
  const std::int64_t lengths[4] = {1, 2, 100, 300};  // the first is shorter than Q = 2
  std::vector<kvattn::SeqId> seqs;
  for (std::int64_t n : lengths) {
    seqs.push_back(cache.add_sequence());
    cache.append(seqs.back(), n);
  }
  const kvattn::BatchPageTable table = cache.page_table(seqs);
  const kvattn::PagedKvView<float> view = cache.view(table, 0);
  const int Q = 2;
  const std::int64_t row = std::int64_t{s.q_heads} * s.head_dim;
  const Prompt pr = random_prompt(s, 4 * Q, 8);
  std::vector<float> q = pr.q;
  kvattn::rotate_decode_queries(rope, view, q.data(), Q, s.q_heads, Isa{});
  for (int b = 0; b < 4; ++b) {
    // The positions decode() gives these queries: L - Q and L - Q + 1 (negative: rotated backwards).
    std::vector<double> ref = rotate_exact(rc, pr.q.data() + b * Q * row, Q, s.q_heads, lengths[b] - Q);
    for (std::int64_t e = 0; e < Q * row; ++e) {
      const float* head = pr.q.data() + b * Q * row + e / s.head_dim * s.head_dim;
      const double bound = kRopeBound * pair_scale(rc, head, static_cast<int>(e % s.head_dim));
      ASSERT_NEAR(q[static_cast<std::size_t>(b * Q * row + e)], ref[static_cast<std::size_t>(e)], bound)
          << "sequence " << b << " element " << e;
    }
  }
  // Exactly apply_rope at those positions.
  std::vector<float> expect = pr.q;
  std::vector<std::int64_t> positions;
  for (std::int64_t n : lengths)
    for (int i = 0; i < Q; ++i) positions.push_back(n - Q + i);
  kvattn::apply_rope(rope, expect.data(), 4 * Q, s.q_heads, positions.data(), Isa{});
  EXPECT_TRUE(same_bits(q, expect));
  // More queries per sequence than one block of positions (64).
  const int Q2 = 70;
  const Prompt many = random_prompt(s, 4 * Q2, 9);
  std::vector<float> q2 = many.q, expect2 = many.q;
  kvattn::rotate_decode_queries(rope, view, q2.data(), Q2, s.q_heads, Isa{});
  positions.clear();
  for (std::int64_t n : lengths)
    for (int i = 0; i < Q2; ++i) positions.push_back(n - Q2 + i);
  kvattn::apply_rope(rope, expect2.data(), 4 * Q2, s.q_heads, positions.data(), Isa{});
  EXPECT_TRUE(same_bits(q2, expect2));
}

// --- Errors: checked first, nothing changed. ---------------------------------------------------

/// Runs `call`, expects exception E whose message contains every one of `parts`.
template <class E, class F> void expect_error(F&& call, std::initializer_list<const char*> parts) {
  try {
    call();
    ADD_FAILURE() << "no exception";
  } catch (const E& e) {
    for (const char* part : parts) EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what() << " lacks " << part;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "another exception: " << e.what();
  }
}

TEST(RopeAppendErrors, WriteKvChecksEverythingFirst) {
  const GqaShape s = GqaShape::gqa(4, 2, 64);
  kvattn::PagedKvCache<kvattn::fp16> cache(kvattn::CacheConfig{2, 4, 6, s});
  const kvattn::Rope rope(RopeConfig{RopeStyle::neox, 64, 0, 10000.0});
  const kvattn::Rope wide(RopeConfig{RopeStyle::neox, 128, 0, 10000.0});
  const auto seq = cache.add_sequence();
  cache.append(seq, 10);
  const Prompt pr = random_prompt(s, 10, 1);
  kvattn::AppendWorkspace ws;
  kvattn::write_kv(cache, seq, 0, 0, 10, pr.k.data(), pr.v.data(), &rope, ws);
  const auto child = cache.fork(seq);  // shares all 3 pages
  const auto before = cache_snapshot::snapshot(cache);
  const float* k = pr.k.data();
  const float* v = pr.v.data();
  using kvattn::write_kv;
  expect_error<kvattn::shape_error>([&] { write_kv(cache, seq, 0, 0, 1, k, v, &wide, ws); },
                                    {"write_kv", "rope head_dim=128", "head_dim=64"});
  expect_error<kvattn::invalid_argument>([&] { write_kv(cache, seq, 0, 8, 3, k, v, &rope, ws); },
                                         {"write_kv(seq=0, position=8, count=3)", "holds 10 tokens"});
  expect_error<kvattn::invalid_argument>([&] { write_kv(cache, seq, 0, -1, 1, k, v, &rope, ws); }, {"position=-1"});
  expect_error<kvattn::invalid_argument>([&] { write_kv(cache, seq, 0, 0, 0, k, v, &rope, ws); }, {"count=0"});
  expect_error<kvattn::invalid_argument>([&] { write_kv(cache, seq, 2, 0, 1, k, v, &rope, ws); }, {"layer=2", "[0, 2)"});
  expect_error<kvattn::invalid_argument>([&] { write_kv(cache, seq + 7, 0, 0, 1, k, v, &rope, ws); }, {"seq=7", "no such sequence"});
  expect_error<kvattn::invalid_argument>([&] { write_kv(cache, seq, 0, 0, 1, nullptr, v, &rope, ws); }, {"null"});
  expect_error<kvattn::invalid_argument>([&] { write_kv(cache, seq, 0, 0, 1, k, nullptr, nullptr, ws); }, {"null"});
  EXPECT_TRUE(cache_snapshot::same_state(before, cache_snapshot::snapshot(cache)));
  // A write into the shared pages needs a copy of each: with 2 of the 3 free pages taken, a write
  // over all 3 shared pages cannot be met.
  const auto filler = cache.add_sequence();
  cache.append(filler, 8);
  const auto full = cache_snapshot::snapshot(cache);
  expect_error<kvattn::capacity_error>([&] { write_kv(cache, child, 1, 0, 10, k, v, &rope, ws); }, {"write", "free page"});
  EXPECT_TRUE(cache_snapshot::same_state(full, cache_snapshot::snapshot(cache)));
  cache.check_invariants();
}

TEST(RopeAppendErrors, WriteKvRejectsAnMlaCache) {
  kvattn::MlaShape m;
  m.heads = 4;
  m.latent_dim = 32;
  m.rope_dim = 16;
  m.nope_dim = 32;
  m.v_head_dim = 32;
  kvattn::PagedKvCache<float> cache(kvattn::CacheConfig{1, 4, 4, m});
  const auto seq = cache.add_sequence();
  cache.append(seq, 3);
  const kvattn::Rope rope(RopeConfig{RopeStyle::gptj, 16, 0, 10000.0});
  std::vector<float> x(3 * 48);
  kvattn::AppendWorkspace ws;
  const auto before = cache_snapshot::snapshot(cache);
  expect_error<kvattn::invalid_argument>([&] { kvattn::write_kv(cache, seq, 0, 0, 3, x.data(), x.data(), &rope, ws); }, {"MLA"});
  EXPECT_TRUE(cache_snapshot::same_state(before, cache_snapshot::snapshot(cache)));
}

TEST(RopeAppendErrors, PrefillChecksTheRopeFirst) {
  const GqaShape s = GqaShape::gqa(4, 2, 64);
  kvattn::PagedKvCache<kvattn::bf16> cache(kvattn::CacheConfig{1, 16, 4, s});
  const auto seq = cache.add_sequence();
  cache.append(seq, 10);
  const Prompt pr = random_prompt(s, 10, 2);
  std::vector<float> out(pr.q.size());
  kvattn::PrefillPlan plan;
  const kvattn::Rope narrow(RopeConfig{RopeStyle::gptj, 32, 0, 10000.0});
  const kvattn::Rope rope(RopeConfig{RopeStyle::gptj, 64, 0, 10000.0});
  kvattn::PrefillParams p;
  p.rope = &narrow;
  const auto before = cache_snapshot::snapshot(cache);
  expect_error<kvattn::shape_error>([&] { plan.make(cache, {{seq, 10}}, s, p, 1); },
                                    {"PrefillPlan::make", "rope head_dim=32", "head_dim=64"});
  p.rope = &rope;
  expect_error<kvattn::invalid_argument>([&] { plan.make(cache, {{seq, 11}}, s, p, 1); }, {"append the chunk first"});
  plan.make(cache, {{seq, 10}}, s, p, 1);
  expect_error<kvattn::invalid_argument>(
      [&] { kvattn::prefill(cache, 1, pr.q.data(), pr.k.data(), pr.v.data(), out.data(), nullptr, plan); }, {"prefill", "layer=1"});
  EXPECT_TRUE(cache_snapshot::same_state(before, cache_snapshot::snapshot(cache)));
}

TEST(RopeAppendErrors, RotateDecodeQueriesChecksFirst) {
  const GqaShape s = GqaShape::gqa(4, 2, 64);
  kvattn::PagedKvCache<float> cache(kvattn::CacheConfig{1, 16, 4, s});
  const auto seq = cache.add_sequence();
  cache.append(seq, 5);
  const kvattn::BatchPageTable table = cache.page_table({seq});
  const auto view = cache.view(table, 0);
  const kvattn::Rope wide(RopeConfig{RopeStyle::neox, 128, 0, 10000.0});
  const kvattn::Rope rope(RopeConfig{RopeStyle::neox, 64, 0, 10000.0});
  std::vector<float> q = random_prompt(s, 1, 3).q;
  const std::vector<float> given = q;
  expect_error<kvattn::shape_error>([&] { kvattn::rotate_decode_queries(wide, view, q.data(), 1, 4); },
                                    {"rotate_decode_queries", "rope head_dim=128", "head_dim=64"});
  expect_error<kvattn::invalid_argument>([&] { kvattn::rotate_decode_queries(rope, view, q.data(), 0, 4); }, {"queries_per_seq=0"});
  expect_error<kvattn::invalid_argument>([&] { kvattn::rotate_decode_queries(rope, view, q.data(), 1, 0); }, {"q_heads=0"});
  expect_error<kvattn::invalid_argument>([&] { kvattn::rotate_decode_queries(rope, view, nullptr, 1, 4); }, {"null"});
  EXPECT_TRUE(same_bits(q, given));
}

}  // namespace
