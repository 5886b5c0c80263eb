// kvattn/simd.hpp — the few vector operations attention kernels are written against.
//
// Vec<Isa> holds Vec<Isa>::lanes floats. Generic kernels use only these operations; each
// instruction set specializes Vec with its intrinsics, and Vec<isa::scalar> (one lane) is plain
// C++, so the scalar kernel reads like the math. Loads convert from the storage type (fp32,
// fp16, bf16, and the 8-bit formats' values without their row's scale, which kernels apply per
// token: format.hpp's to_float);
// load_partial / store_partial touch only the first n lanes (0 <= n < lanes).
//
// Two operations exist for kernels that stream keys and values:
//   load_pair(p, a, b)  converts 2 · lanes elements at once. Where it is cheaper (bf16 on the
//                       vector ISAs: one 32-bit lane holds two bf16, and each becomes a float
//                       by one shift or one mask) a holds the even elements and b the odd ones
//                       (interleaves_pairs<T> is then true); otherwise a = p[0, lanes) and
//                       b = p[lanes, 2 · lanes). A kernel stores the vectors it multiplies with
//                       in the same order once (pair_order below) and never shuffles per load.
//                       q4_block (two values a unit) reads 2 · lanes values from lanes units,
//                       their codes 0-15 as floats, a = the first lanes values, b = the next:
//                       the caller applies the block's scale and minimum (block_scale).
//   block_scale(s, d, m) a BlockScale's scale and minimum, each in every lane.
//   sum_each(v)         lanes vectors in, one out: lane i is the sum of v[i]'s lanes. A
//                       transposing tree of adds, a few operations per vector instead of the
//                       full reduction each reduce_add costs.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "config.hpp"
#include "format.hpp"
#include "storage.hpp"

#if KVATTN_HAS_AVX2 || KVATTN_HAS_AVX512
#include <immintrin.h>
#endif
#if KVATTN_HAS_NEON
#include <arm_neon.h>
#endif

namespace kvattn {
KVATTN_BEGIN_TARGET_NAMESPACE
namespace simd {

template <class Isa> struct Vec;

template <> struct Vec<isa::scalar> {
  static constexpr int lanes = 1;
  float v;
  static Vec zero() noexcept { return {0.0f}; }
  static Vec set1(float x) noexcept { return {x}; }
  template <class T> static Vec load(const T* p) noexcept { return {to_float(*p)}; }
  template <class T> static Vec load_partial(const T* p, int n) noexcept { return {n > 0 ? to_float(*p) : 0.0f}; }
  void store(float* p) const noexcept { *p = v; }
  void store_partial(float* p, int n) const noexcept {
    if (n > 0) *p = v;
  }
  friend Vec fma(Vec a, Vec b, Vec c) noexcept { return {a.v * b.v + c.v}; }  // a·b + c
  friend Vec operator*(Vec a, Vec b) noexcept { return {a.v * b.v}; }
  friend Vec operator+(Vec a, Vec b) noexcept { return {a.v + b.v}; }
  friend Vec operator-(Vec a, Vec b) noexcept { return {a.v - b.v}; }
  friend Vec max(Vec a, Vec b) noexcept { return {a.v > b.v ? a.v : b.v}; }
  friend bool any_greater(Vec a, Vec b) noexcept { return a.v > b.v; }  // some lane of a > b's (NaN: no)
  friend Vec select_greater(Vec a, Vec b, Vec x, Vec y) noexcept { return a.v > b.v ? x : y; }  // lane-wise a > b ? x : y (NaN: y)
  friend Vec exp(Vec a) noexcept { return {a.v >= -87.0f ? std::exp(a.v) : 0.0f}; }  // as the SIMD ones: NaN -> 0
  float reduce_add() const noexcept { return v; }
  float reduce_max() const noexcept { return v; }
  template <class T> static constexpr bool interleaves_pairs = false;
  template <class T> static void load_pair(const T* p, Vec& a, Vec& b) noexcept {
    a = load(p);
    b = load(p + 1);
  }
  static void load_pair(const q4_block* p, Vec& a, Vec& b) noexcept {  // the byte's low four bits, then its high four
    a.v = static_cast<float>(p->bits & 0xF);
    b.v = static_cast<float>(p->bits >> 4);
  }
  static void load_pair(const hadamard<q4_block>* p, Vec& a, Vec& b) noexcept { load_pair(static_cast<const q4_block*>(p), a, b); }
  static void block_scale(const BlockScale* s, Vec& d, Vec& m) noexcept {
    d.v = to_float(s->d);
    m.v = to_float(s->m);
  }
  static Vec sum_each(const Vec* v) noexcept { return v[0]; }
};

namespace detail {
// exp(x) for x <= 0 (softmax arguments): 2^(x·log2 e) split as 2^k · 2^f, f in [-0.5, 0.5],
// 2^f by a degree-6 polynomial (relative error below 2e-7); x below -87, and NaN, give 0 (in
// every Vec, the scalar one included).
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kExpPoly[7] = {1.0f, 0.693147182f, 0.240226507f, 0.0555041087f, 0.00961812911f, 0.00133335581f, 0.000154035304f};
}  // namespace detail

#if KVATTN_HAS_AVX2
template <> struct Vec<isa::avx2> {
  static constexpr int lanes = 8;
  __m256 v;
  static Vec zero() noexcept { return {_mm256_setzero_ps()}; }
  static Vec set1(float x) noexcept { return {_mm256_set1_ps(x)}; }
  static Vec load(const float* p) noexcept { return {_mm256_loadu_ps(p)}; }
  static Vec load(const fp16* p) noexcept { return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
  static Vec load(const bf16* p) noexcept {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
  }
  static Vec load(const int8_row* p) noexcept {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
  }
  // fp8 e4m3 bytes b as the fp16 ((b & 0x80) << 8) | ((b & 0x7F) << 7) (format.hpp): each byte
  // in the high half of a 16-bit lane, shifted right by one with its sign, bit 14 cleared.
  static __m128i fp8_as_fp16(__m128i bytes_high) noexcept {
    return _mm_and_si128(_mm_srai_epi16(bytes_high, 1), _mm_set1_epi16(static_cast<short>(0xBFFF)));
  }
  static Vec load(const fp8_e4m3_row* p) noexcept {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return {_mm256_cvtph_ps(fp8_as_fp16(_mm_unpacklo_epi8(_mm_setzero_si128(), b)))};
  }
  template <class T> static Vec load_partial(const T* p, int n) noexcept {
    T tmp[lanes] = {};
    std::memcpy(static_cast<void*>(tmp), static_cast<const void*>(p), sizeof(T) * static_cast<std::size_t>(n));
    return load(tmp);
  }
  void store(float* p) const noexcept { _mm256_storeu_ps(p, v); }
  void store_partial(float* p, int n) const noexcept {
    float tmp[lanes];
    _mm256_storeu_ps(tmp, v);
    std::memcpy(p, tmp, sizeof(float) * static_cast<std::size_t>(n));
  }
  friend Vec fma(Vec a, Vec b, Vec c) noexcept { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  friend Vec operator*(Vec a, Vec b) noexcept { return {_mm256_mul_ps(a.v, b.v)}; }
  friend Vec operator+(Vec a, Vec b) noexcept { return {_mm256_add_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) noexcept { return {_mm256_sub_ps(a.v, b.v)}; }
  friend Vec max(Vec a, Vec b) noexcept { return {_mm256_max_ps(a.v, b.v)}; }
  friend bool any_greater(Vec a, Vec b) noexcept { return _mm256_movemask_ps(_mm256_cmp_ps(a.v, b.v, _CMP_GT_OQ)) != 0; }
  friend Vec select_greater(Vec a, Vec b, Vec x, Vec y) noexcept { return {_mm256_blendv_ps(y.v, x.v, _mm256_cmp_ps(a.v, b.v, _CMP_GT_OQ))}; }
  friend Vec exp(Vec a) noexcept {
    const __m256 x = _mm256_max_ps(_mm256_mul_ps(a.v, _mm256_set1_ps(detail::kLog2e)), _mm256_set1_ps(-126.0f));
    const __m256 k = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, k);
    __m256 p = _mm256_set1_ps(detail::kExpPoly[6]);
    for (int i = 5; i >= 0; --i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(detail::kExpPoly[i]));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    const __m256 r = _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
    return {_mm256_and_ps(r, _mm256_cmp_ps(a.v, _mm256_set1_ps(-87.0f), _CMP_GE_OQ))};
  }
  float reduce_add() const noexcept {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
  }
  float reduce_max() const noexcept {
    const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
  }
  template <class T> static constexpr bool interleaves_pairs = std::is_same_v<T, bf16>;
  template <class T> static void load_pair(const T* p, Vec& a, Vec& b) noexcept {
    a = load(p);
    b = load(p + lanes);
  }
  static void load_pair(const int8_row* p, Vec& a, Vec& b) noexcept {  // one load of 16 bytes
    const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    a.v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(w));
    b.v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(w, w)));
  }
  static void load_pair(const fp8_e4m3_row* p, Vec& a, Vec& b) noexcept {  // one load of 16 bytes
    const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    a.v = _mm256_cvtph_ps(fp8_as_fp16(_mm_unpacklo_epi8(_mm_setzero_si128(), w)));
    b.v = _mm256_cvtph_ps(fp8_as_fp16(_mm_unpackhi_epi8(_mm_setzero_si128(), w)));
  }
  static void load_pair(const fp8_e4m3_layer* p, Vec& a, Vec& b) noexcept { load_pair(static_cast<const fp8_e4m3_row*>(p), a, b); }
  // 8 codes of 4 bits (4 bytes, the even column in each byte's low bits): the 32-bit word in every
  // lane, lane i shifted right by 4i and masked.
  static Vec q4_codes(const q4_block* p) noexcept {
    std::int32_t w;
    std::memcpy(&w, p, sizeof w);
    const __m256i x = _mm256_srlv_epi32(_mm256_set1_epi32(w), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    return {_mm256_cvtepi32_ps(_mm256_and_si256(x, _mm256_set1_epi32(0xF)))};
  }
  static void load_pair(const q4_block* p, Vec& a, Vec& b) noexcept {
    a = q4_codes(p);
    b = q4_codes(p + 4);
  }
  static void load_pair(const hadamard<q4_block>* p, Vec& a, Vec& b) noexcept { load_pair(static_cast<const q4_block*>(p), a, b); }
  static void block_scale(const BlockScale* s, Vec& d, Vec& m) noexcept {  // both fp16 in one conversion
    std::int32_t w;
    std::memcpy(&w, s, sizeof w);
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(w));
    d.v = _mm256_broadcastss_ps(f);
    m.v = _mm256_broadcastss_ps(_mm_movehdup_ps(f));
  }
  static void load_pair(const bf16* p, Vec& a, Vec& b) noexcept {  // a: even elements, b: odd
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    a.v = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    b.v = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static Vec sum_each(const Vec* v) noexcept {
    __m256 w[4], u[2];
    for (int i = 0; i < 4; ++i)  // per 128-bit half: [x0+x2, y0+y2, x1+x3, y1+y3], x = v[2i], y = v[2i+1]
      w[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i].v, v[2 * i + 1].v), _mm256_unpackhi_ps(v[2 * i].v, v[2 * i + 1].v));
    for (int j = 0; j < 2; ++j)  // per half: the partial sums of v[4j .. 4j+3]
      u[j] = _mm256_add_ps(_mm256_shuffle_ps(w[2 * j], w[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm256_shuffle_ps(w[2 * j], w[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return {_mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31))};
  }
};
#endif  // KVATTN_HAS_AVX2

#if KVATTN_HAS_AVX512
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC bug 105593, as in storage.hpp
#pragma GCC diagnostic ignored "-Wuninitialized"        // the same, as -O1 reports it
#endif
template <> struct Vec<isa::avx512> {
  static constexpr int lanes = 16;
  __m512 v;
  static __mmask16 mask(int n) noexcept { return static_cast<__mmask16>((1u << n) - 1u); }
  static Vec zero() noexcept { return {_mm512_setzero_ps()}; }
  static Vec set1(float x) noexcept { return {_mm512_set1_ps(x)}; }
  static Vec load(const float* p) noexcept { return {_mm512_loadu_ps(p)}; }
  static Vec load(const fp16* p) noexcept { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
  static Vec load(const bf16* p) noexcept {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
  }
  static Vec load_partial(const float* p, int n) noexcept { return {_mm512_maskz_loadu_ps(mask(n), p)}; }
  static Vec load_partial(const fp16* p, int n) noexcept { return {_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask(n), p))}; }
  static Vec load_partial(const bf16* p, int n) noexcept {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask(n), p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
  }
  static Vec load(const int8_row* p) noexcept {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
  }
  static Vec load_partial(const int8_row* p, int n) noexcept {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask(n), p)))};
  }
  // fp8 e4m3 bytes as fp16 (format.hpp; as Vec<avx2>::fp8_as_fp16, 16 at a time).
  static Vec fp8_to_float(__m128i bytes) noexcept {
    const __m256i high = _mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8);
    return {_mm512_cvtph_ps(_mm256_and_si256(_mm256_srai_epi16(high, 1), _mm256_set1_epi16(static_cast<short>(0xBFFF))))};
  }
  static Vec load(const fp8_e4m3_row* p) noexcept { return fp8_to_float(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static Vec load_partial(const fp8_e4m3_row* p, int n) noexcept { return fp8_to_float(_mm_maskz_loadu_epi8(mask(n), p)); }
  void store(float* p) const noexcept { _mm512_storeu_ps(p, v); }
  void store_partial(float* p, int n) const noexcept { _mm512_mask_storeu_ps(p, mask(n), v); }
  friend Vec fma(Vec a, Vec b, Vec c) noexcept { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  friend Vec operator*(Vec a, Vec b) noexcept { return {_mm512_mul_ps(a.v, b.v)}; }
  friend Vec operator+(Vec a, Vec b) noexcept { return {_mm512_add_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) noexcept { return {_mm512_sub_ps(a.v, b.v)}; }
  friend Vec max(Vec a, Vec b) noexcept { return {_mm512_max_ps(a.v, b.v)}; }
  friend bool any_greater(Vec a, Vec b) noexcept { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ) != 0; }
  friend Vec select_greater(Vec a, Vec b, Vec x, Vec y) noexcept { return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ), y.v, x.v)}; }
  friend Vec exp(Vec a) noexcept {
    const __m512 x = _mm512_max_ps(_mm512_mul_ps(a.v, _mm512_set1_ps(detail::kLog2e)), _mm512_set1_ps(-126.0f));
    const __m512 k = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, k);
    __m512 p = _mm512_set1_ps(detail::kExpPoly[6]);
    for (int i = 5; i >= 0; --i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(detail::kExpPoly[i]));
    const __m512 r = _mm512_scalef_ps(p, k);
    return {_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a.v, _mm512_set1_ps(-87.0f), _CMP_GE_OQ), r)};
  }
  float reduce_add() const noexcept { return _mm512_reduce_add_ps(v); }
  float reduce_max() const noexcept { return _mm512_reduce_max_ps(v); }
  template <class T> static constexpr bool interleaves_pairs = std::is_same_v<T, bf16>;
  template <class T> static void load_pair(const T* p, Vec& a, Vec& b) noexcept {
    a = load(p);
    b = load(p + lanes);
  }
  // 32 codes of 4 bits (16 bytes, the even column in each byte's low bits): a = the first 16
  // (bytes 0-7), b = the next; lane i of a holds 32-bit word i / 8 shifted right by 4 · (i % 8).
  static void load_pair(const q4_block* p, Vec& a, Vec& b) noexcept {
    const __m512i w = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    const __m512i low4 = _mm512_set1_epi32(0xF);
    const __m512i wa = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), w);
    const __m512i wb = _mm512_permutexvar_epi32(_mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3), w);
    a.v = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(wa, shifts), low4));
    b.v = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(wb, shifts), low4));
  }
  static void load_pair(const hadamard<q4_block>* p, Vec& a, Vec& b) noexcept { load_pair(static_cast<const q4_block*>(p), a, b); }
  static void block_scale(const BlockScale* s, Vec& d, Vec& m) noexcept {
    std::int32_t w;
    std::memcpy(&w, s, sizeof w);
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(w));
    d.v = _mm512_broadcastss_ps(f);
    m.v = _mm512_broadcastss_ps(_mm_movehdup_ps(f));
  }
  static void load_pair(const bf16* p, Vec& a, Vec& b) noexcept {  // a: even elements, b: odd
    const __m512i w = _mm512_loadu_si512(p);
    a.v = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    b.v = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static Vec sum_each(const Vec* v) noexcept {
    __m512 w[8], u[4], z[2];
    for (int i = 0; i < 8; ++i)  // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3], x = v[2i], y = v[2i+1]
      w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i].v, v[2 * i + 1].v), _mm512_unpackhi_ps(v[2 * i].v, v[2 * i + 1].v));
    for (int j = 0; j < 4; ++j)  // per 128-bit lane: the partial sums of v[4j .. 4j+3]
      u[j] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * j], w[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(w[2 * j], w[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int k = 0; k < 2; ++k)  // [u(2k) lanes 0+1, u(2k) lanes 2+3, u(2k+1) lanes 0+1, u(2k+1) lanes 2+3]
      z[k] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return {_mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)))};
  }
};
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif  // KVATTN_HAS_AVX512

#if KVATTN_HAS_NEON
template <> struct Vec<isa::neon> {
  static constexpr int lanes = 4;
  float32x4_t v;
  static Vec zero() noexcept { return {vdupq_n_f32(0.0f)}; }
  static Vec set1(float x) noexcept { return {vdupq_n_f32(x)}; }
  static Vec load(const float* p) noexcept { return {vld1q_f32(p)}; }
  static Vec load(const fp16* p) noexcept {
    return {vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const std::uint16_t*>(p))))};
  }
  static Vec load(const bf16* p) noexcept {
    return {vreinterpretq_f32_u32(vshlq_n_u32(vmovl_u16(vld1_u16(reinterpret_cast<const std::uint16_t*>(p))), 16))};
  }
  static Vec load(const int8_row* p) noexcept {
    std::int32_t w;
    std::memcpy(&w, p, sizeof w);
    const int16x8_t h = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(w)));
    return {vcvtq_f32_s32(vmovl_s16(vget_low_s16(h)))};
  }
  // fp8 e4m3 bytes as fp16 (format.hpp): each byte widened into the high half of a 16-bit lane,
  // shifted right by one with its sign, bit 14 cleared.
  static float16x8_t fp8_as_fp16(uint8x8_t bytes) noexcept {
    const int16x8_t high = vreinterpretq_s16_u16(vshll_n_u8(bytes, 8));
    return vreinterpretq_f16_s16(vandq_s16(vshrq_n_s16(high, 1), vdupq_n_s16(static_cast<std::int16_t>(0xBFFF))));
  }
  static Vec load(const fp8_e4m3_row* p) noexcept {
    std::uint32_t w;
    std::memcpy(&w, p, sizeof w);
    return {vcvt_f32_f16(vget_low_f16(fp8_as_fp16(vreinterpret_u8_u32(vdup_n_u32(w)))))};
  }
  template <class T> static Vec load_partial(const T* p, int n) noexcept {
    T tmp[lanes] = {};
    std::memcpy(static_cast<void*>(tmp), static_cast<const void*>(p), sizeof(T) * static_cast<std::size_t>(n));
    return load(tmp);
  }
  void store(float* p) const noexcept { vst1q_f32(p, v); }
  void store_partial(float* p, int n) const noexcept {
    float tmp[lanes];
    vst1q_f32(tmp, v);
    std::memcpy(p, tmp, sizeof(float) * static_cast<std::size_t>(n));
  }
  friend Vec fma(Vec a, Vec b, Vec c) noexcept { return {vfmaq_f32(c.v, a.v, b.v)}; }
  friend Vec operator*(Vec a, Vec b) noexcept { return {vmulq_f32(a.v, b.v)}; }
  friend Vec operator+(Vec a, Vec b) noexcept { return {vaddq_f32(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) noexcept { return {vsubq_f32(a.v, b.v)}; }
  friend Vec max(Vec a, Vec b) noexcept { return {vmaxq_f32(a.v, b.v)}; }
  friend bool any_greater(Vec a, Vec b) noexcept { return vmaxvq_u32(vcgtq_f32(a.v, b.v)) != 0; }
  friend Vec select_greater(Vec a, Vec b, Vec x, Vec y) noexcept { return {vbslq_f32(vcgtq_f32(a.v, b.v), x.v, y.v)}; }
  friend Vec exp(Vec a) noexcept {
    const float32x4_t x = vmaxq_f32(vmulq_n_f32(a.v, detail::kLog2e), vdupq_n_f32(-126.0f));
    const float32x4_t k = vrndnq_f32(x);
    const float32x4_t f = vsubq_f32(x, k);
    float32x4_t p = vdupq_n_f32(detail::kExpPoly[6]);
    for (int i = 5; i >= 0; --i) p = vfmaq_f32(vdupq_n_f32(detail::kExpPoly[i]), p, f);
    const int32x4_t scale = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(k), vdupq_n_s32(127)), 23);
    const float32x4_t r = vmulq_f32(p, vreinterpretq_f32_s32(scale));
    return {vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(r), vcgeq_f32(a.v, vdupq_n_f32(-87.0f))))};
  }
  float reduce_add() const noexcept { return vaddvq_f32(v); }
  float reduce_max() const noexcept { return vmaxvq_f32(v); }
  template <class T> static constexpr bool interleaves_pairs = std::is_same_v<T, bf16>;
  template <class T> static void load_pair(const T* p, Vec& a, Vec& b) noexcept {
    a = load(p);
    b = load(p + lanes);
  }
  static void load_pair(const int8_row* p, Vec& a, Vec& b) noexcept {  // one load of 8 bytes
    const int16x8_t h = vmovl_s8(vld1_s8(reinterpret_cast<const std::int8_t*>(p)));
    a.v = vcvtq_f32_s32(vmovl_s16(vget_low_s16(h)));
    b.v = vcvtq_f32_s32(vmovl_s16(vget_high_s16(h)));
  }
  static void load_pair(const fp8_e4m3_row* p, Vec& a, Vec& b) noexcept {  // one load of 8 bytes
    const float16x8_t h = fp8_as_fp16(vld1_u8(reinterpret_cast<const std::uint8_t*>(p)));
    a.v = vcvt_f32_f16(vget_low_f16(h));
    b.v = vcvt_f32_f16(vget_high_f16(h));
  }
  static void load_pair(const fp8_e4m3_layer* p, Vec& a, Vec& b) noexcept { load_pair(static_cast<const fp8_e4m3_row*>(p), a, b); }
  // 8 codes of 4 bits (4 bytes, the even column in each byte's low bits): the 32-bit word in every
  // lane, lane i shifted right by 4i (a) or 16 + 4i (b) and masked.
  static void load_pair(const q4_block* p, Vec& a, Vec& b) noexcept {
    std::uint32_t w;
    std::memcpy(&w, p, sizeof w);
    const uint32x4_t x = vdupq_n_u32(w), low4 = vdupq_n_u32(0xF);
    static constexpr std::int32_t kShiftA[4] = {0, -4, -8, -12}, kShiftB[4] = {-16, -20, -24, -28};
    a.v = vcvtq_f32_u32(vandq_u32(vshlq_u32(x, vld1q_s32(kShiftA)), low4));
    b.v = vcvtq_f32_u32(vandq_u32(vshlq_u32(x, vld1q_s32(kShiftB)), low4));
  }
  static void load_pair(const hadamard<q4_block>* p, Vec& a, Vec& b) noexcept { load_pair(static_cast<const q4_block*>(p), a, b); }
  static void block_scale(const BlockScale* s, Vec& d, Vec& m) noexcept {
    std::uint32_t w;
    std::memcpy(&w, s, sizeof w);
    const float32x4_t f = vcvt_f32_f16(vreinterpret_f16_u32(vdup_n_u32(w)));
    d.v = vdupq_laneq_f32(f, 0);
    m.v = vdupq_laneq_f32(f, 1);
  }
  static void load_pair(const bf16* p, Vec& a, Vec& b) noexcept {  // a: even elements, b: odd
    const uint32x4_t w = vld1q_u32(reinterpret_cast<const std::uint32_t*>(p));
    a.v = vreinterpretq_f32_u32(vshlq_n_u32(w, 16));
    b.v = vreinterpretq_f32_u32(vandq_u32(w, vdupq_n_u32(0xFFFF0000u)));
  }
  static Vec sum_each(const Vec* v) noexcept {
    return {vpaddq_f32(vpaddq_f32(v[0].v, v[1].v), vpaddq_f32(v[2].v, v[3].v))};
  }
};
#endif  // KVATTN_HAS_NEON

/// Integer dot products of int8 rows, for int8 keys scored against int8 queries
/// (DecodeParams::int8_queries); I8Dot<Isa>::available where the instruction set has them
/// (AVX-512 VNNI; AVX-VNNI on an AVX2 build, else AVX2's vpmaddubsw and vpmaddwd; NEON's dot
/// product):
///   bytes              int8 values one step reads and multiplies;
///   Acc, zero()        lanes of int32 partial sums;
///   load_key(p)        `bytes` key values, in the form dot takes them (load_key_partial: the
///                      first n, 0 < n < bytes);
///   load_query(p)      `bytes` query values (a query row is zero-padded to whole steps);
///   dot(acc, k, q)     acc + the products, summed four at a time into each int32 lane;
///   key_offset         what load_key adds to each key value (AVX-512 VNNI multiplies unsigned
///                      by signed bytes, so keys are read as k + 128): the lanes then sum to
///                      k · q + key_offset · Σ q, and the caller subtracts the second term;
///   to_vec(acc)        the lanes as floats, exact (|k · q| < 2^24 for head_dim <= 1024);
///   value_columns      for 8-bit probabilities times int8 values (DecodeParams::
///                      u8_probabilities), the columns one pass covers (load_values,
///                      pack_probabilities, dot_values, add_values); 0: none (fp32 instead).
template <class Isa> struct I8Dot {
  static constexpr bool available = false;
  static constexpr int key_offset = 0;
  static constexpr int value_columns = 0;
};
#if KVATTN_HAS_AVX2 && defined(__AVXVNNI__)
template <> struct I8Dot<isa::avx2> {  // AVX-VNNI: the same instruction on 256-bit vectors
  static constexpr bool available = true;
  static constexpr int bytes = 32;
  static constexpr int key_offset = 128;
  static constexpr int value_columns = 0;  // values: fp32 multiply-adds
  using Acc = __m256i;
  static Acc zero() noexcept { return _mm256_setzero_si256(); }
  static __m256i load_key(const int8_row* p) noexcept {
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_set1_epi8(-128));
  }
  static __m256i load_key_partial(const int8_row* p, int n) noexcept {
    alignas(32) std::int8_t tmp[bytes] = {};
    std::memcpy(tmp, p, static_cast<std::size_t>(n));
    return _mm256_xor_si256(_mm256_load_si256(reinterpret_cast<const __m256i*>(tmp)), _mm256_set1_epi8(-128));
  }
  static __m256i load_query(const std::int8_t* p) noexcept { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static Acc dot(Acc acc, __m256i k, __m256i q) noexcept { return _mm256_dpbusd_avx_epi32(acc, k, q); }
  static Vec<isa::avx2> to_vec(Acc a) noexcept { return {_mm256_cvtepi32_ps(a)}; }
};
#elif KVATTN_HAS_AVX2
template <> struct I8Dot<isa::avx2> {  // AVX2 alone: vpmaddubsw and vpmaddwd
  static constexpr bool available = true;
  static constexpr int bytes = 32;
  static constexpr int key_offset = 0;  // signed keys: |k| times q with k's sign
  static constexpr int value_columns = 0;  // values: fp32 multiply-adds
  using Acc = __m256i;
  /// A key step as vpmaddubsw takes it: |k| (unsigned) and k (for its signs). Keys and queries
  /// are in [-127, 127] (int8_row never stores -128), so a pair of products, at most
  /// 2 · 127 · 127, never saturates vpmaddubsw's 16-bit sums.
  struct Key {
    __m256i magnitude, k;
  };
  static Acc zero() noexcept { return _mm256_setzero_si256(); }
  static Key load_key(const int8_row* p) noexcept {
    const __m256i k = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm256_sign_epi8(k, k), k};
  }
  static Key load_key_partial(const int8_row* p, int n) noexcept {
    alignas(32) std::int8_t tmp[bytes] = {};
    std::memcpy(tmp, p, static_cast<std::size_t>(n));
    return load_key(reinterpret_cast<const int8_row*>(tmp));
  }
  static __m256i load_query(const std::int8_t* p) noexcept { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static Acc dot(Acc acc, const Key& k, __m256i q) noexcept {
    const __m256i pairs = _mm256_maddubs_epi16(k.magnitude, _mm256_sign_epi8(q, k.k));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  static Vec<isa::avx2> to_vec(Acc a) noexcept { return {_mm256_cvtepi32_ps(a)}; }
};
#endif
#if KVATTN_HAS_AVX512 && defined(__AVX512VNNI__)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC bug 105593, as in storage.hpp
#pragma GCC diagnostic ignored "-Wuninitialized"        // the same, as -O3 reports it for add_values
#endif
template <> struct I8Dot<isa::avx512> {
  static constexpr bool available = true;
  static constexpr int bytes = 64;
  static constexpr int key_offset = 128;
  using Acc = __m512i;
  static Acc zero() noexcept { return _mm512_setzero_si512(); }
  static __m512i load_key(const int8_row* p) noexcept {
    return _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_set1_epi8(-128));
  }
  static __m512i load_key_partial(const int8_row* p, int n) noexcept {
    return _mm512_xor_si512(_mm512_maskz_loadu_epi8((__mmask64{1} << n) - 1, p), _mm512_set1_epi8(-128));
  }
  static __m512i load_query(const std::int8_t* p) noexcept { return _mm512_loadu_si512(p); }
  static Acc dot(Acc acc, __m512i k, __m512i q) noexcept { return _mm512_dpbusd_epi32(acc, k, q); }
  static Vec<isa::avx512> to_vec(Acc a) noexcept { return {_mm512_cvtepi32_ps(a)}; }

  // Values (DecodeParams::u8_probabilities): value_columns columns of four tokens' value rows
  // at a time, the four tokens' bytes of each column side by side in one int32 lane.
  static constexpr int value_columns = 64;
  /// r[i]: token i's value row at the pass's first column. v[j] lane 4l + i holds the four tokens'
  /// values of column 16l + 4j + i (the unpacks work within 128-bit lanes).
  template <class T> static void load_values(const T* const* r, __m512i* v) noexcept {
    const __m512i a0 = _mm512_loadu_si512(r[0]), a1 = _mm512_loadu_si512(r[1]);
    const __m512i a2 = _mm512_loadu_si512(r[2]), a3 = _mm512_loadu_si512(r[3]);
    const __m512i l01 = _mm512_unpacklo_epi8(a0, a1), h01 = _mm512_unpackhi_epi8(a0, a1);
    const __m512i l23 = _mm512_unpacklo_epi8(a2, a3), h23 = _mm512_unpackhi_epi8(a2, a3);
    v[0] = _mm512_unpacklo_epi16(l01, l23);
    v[1] = _mm512_unpackhi_epi16(l01, l23);
    v[2] = _mm512_unpacklo_epi16(h01, h23);
    v[3] = _mm512_unpackhi_epi16(h01, h23);
  }
  /// p8[t] = round(s[t] · inv) for t < 32, s[t] · inv in [0, 255].
  static void pack_probabilities(const float* s, float inv, std::uint8_t* p8) noexcept {
    const __m512 f = _mm512_set1_ps(inv);
    for (int g = 0; g < 32; g += 16)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p8 + g),
                       _mm512_cvtusepi32_epi8(_mm512_cvtps_epu32(_mm512_mul_ps(_mm512_loadu_ps(s + g), f))));
  }
  /// acc + Σ_i p[i] · v (four tokens' unsigned probabilities, one byte each, times their values).
  static Acc dot_values(Acc acc, std::uint32_t p, __m512i v) noexcept {
    return _mm512_dpbusd_epi32(acc, _mm512_set1_epi32(static_cast<int>(p)), v);
  }
  /// o[0, 64) = alpha · o + f · acc, acc[j] in load_values' order.
  static void add_values(float* o, const Acc* acc, float f, float alpha) noexcept {
    const __m512 x0 = _mm512_cvtepi32_ps(acc[0]), x1 = _mm512_cvtepi32_ps(acc[1]);
    const __m512 x2 = _mm512_cvtepi32_ps(acc[2]), x3 = _mm512_cvtepi32_ps(acc[3]);
    const __m512 u0 = _mm512_shuffle_f32x4(x0, x1, 0x44), u1 = _mm512_shuffle_f32x4(x0, x1, 0xEE);
    const __m512 u2 = _mm512_shuffle_f32x4(x2, x3, 0x44), u3 = _mm512_shuffle_f32x4(x2, x3, 0xEE);
    const __m512 col[4] = {_mm512_shuffle_f32x4(u0, u2, 0x88), _mm512_shuffle_f32x4(u0, u2, 0xDD),
                           _mm512_shuffle_f32x4(u1, u3, 0x88), _mm512_shuffle_f32x4(u1, u3, 0xDD)};
    const __m512 vf = _mm512_set1_ps(f), va = _mm512_set1_ps(alpha);
    for (int l = 0; l < 4; ++l)
      _mm512_storeu_ps(o + 16 * l, _mm512_fmadd_ps(vf, col[l], _mm512_mul_ps(_mm512_loadu_ps(o + 16 * l), va)));
  }
};
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif
#if KVATTN_HAS_NEON && defined(__ARM_FEATURE_DOTPROD)
template <> struct I8Dot<isa::neon> {
  static constexpr bool available = true;
  static constexpr int bytes = 16;
  static constexpr int key_offset = 0;  // sdot multiplies signed by signed bytes
  static constexpr int value_columns = 0;  // values: fp32 multiply-adds
  using Acc = int32x4_t;
  static Acc zero() noexcept { return vdupq_n_s32(0); }
  static int8x16_t load_key(const int8_row* p) noexcept { return vld1q_s8(reinterpret_cast<const std::int8_t*>(p)); }
  static int8x16_t load_key_partial(const int8_row* p, int n) noexcept {
    std::int8_t tmp[bytes] = {};
    std::memcpy(tmp, p, static_cast<std::size_t>(n));
    return vld1q_s8(tmp);
  }
  static int8x16_t load_query(const std::int8_t* p) noexcept { return vld1q_s8(p); }
  static Acc dot(Acc acc, int8x16_t k, int8x16_t q) noexcept { return vdotq_s32(acc, k, q); }
  static Vec<isa::neon> to_vec(Acc a) noexcept { return {vcvtq_f32_s32(a)}; }
};
#endif

/// Reorders one row [dim] of floats into the order load_pair<T> delivers pairs in (a no-op copy
/// where pairs are not interleaved): within each whole block of 2 · lanes elements, the even
/// elements first, then the odd ones; the elements after the last whole block keep their places.
template <class Isa, class T> void to_pair_order(const float* in, float* out, int dim) noexcept {
  constexpr int W = Vec<Isa>::lanes;
  int c = 0;
  if constexpr (Vec<Isa>::template interleaves_pairs<T>)
    for (; c + 2 * W <= dim; c += 2 * W)
      for (int j = 0; j < W; ++j) {
        out[c + j] = in[c + 2 * j];
        out[c + W + j] = in[c + 2 * j + 1];
      }
  for (; c < dim; ++c) out[c] = in[c];
}

/// The inverse of to_pair_order, in place.
template <class Isa, class T> void from_pair_order(float* x, int dim) noexcept {
  constexpr int W = Vec<Isa>::lanes;
  if constexpr (Vec<Isa>::template interleaves_pairs<T>) {
    float tmp[2 * W];
    for (int c = 0; c + 2 * W <= dim; c += 2 * W) {
      std::memcpy(tmp, x + c, sizeof tmp);
      for (int j = 0; j < W; ++j) {
        x[c + 2 * j] = tmp[j];
        x[c + 2 * j + 1] = tmp[W + j];
      }
    }
  } else {
    (void)x;
    (void)dim;
  }
}

}  // namespace simd
KVATTN_END_TARGET_NAMESPACE
}  // namespace kvattn
