// tests/test_storage.cpp — storage element types and convert_row, checked against an IEEE 754
// reference written here from the definitions in integer arithmetic only (no Eigen, no
// intrinsics, no floating-point operations).
//
// Every conversion path runs the same checks: element-wise to_float / from_float, bulk
// convert_row for each instruction-set tag (skipped, with the reason, where the tag is not
// compiled in this translation unit), and the isa::native convert_row(src, dst, n).
#include <kvattn/storage.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iomanip>
#include <iostream>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace {

namespace isa = kvattn::isa;
using kvattn::bf16;
using kvattn::fp16;
using kvattn::fp32;

// =============================================================================================
// Reference: binary interchange formats from IEEE 754, integers only.
// =============================================================================================

struct Format {
  int ebits;  // exponent field width
  int mbits;  // trailing significand field width
};
constexpr Format kFp32{8, 23};
constexpr Format kFp16{5, 10};
constexpr Format kBf16{8, 7};

constexpr int bias(Format f) { return (1 << (f.ebits - 1)) - 1; }
constexpr std::uint32_t sign_bit(Format f) { return 1u << (f.ebits + f.mbits); }
constexpr std::uint32_t exp_field_max(Format f) { return (1u << f.ebits) - 1u; }
constexpr std::uint32_t inf_bits(Format f) { return exp_field_max(f) << f.mbits; }
constexpr std::uint32_t quiet_nan_bits(Format f) { return inf_bits(f) | (1u << (f.mbits - 1)); }
constexpr bool is_nan_bits(std::uint32_t bits, Format f) { return (bits & (sign_bit(f) - 1u)) > inf_bits(f); }

// A decoded datum: (-1)^neg * m * 2^e when finite.
struct Datum {
  enum class Kind { zero, finite, inf, nan } kind;
  bool neg;
  std::uint64_t m;
  int e;
};

Datum decode(std::uint32_t bits, Format f) {
  Datum d{Datum::Kind::finite, (bits & sign_bit(f)) != 0, 0, 0};
  const std::uint32_t efield = (bits >> f.mbits) & exp_field_max(f);
  const std::uint32_t mfield = bits & ((1u << f.mbits) - 1u);
  if (efield == exp_field_max(f)) {
    d.kind = mfield == 0 ? Datum::Kind::inf : Datum::Kind::nan;
  } else if (efield == 0) {  // zero or subnormal: 0.mfield * 2^(1 - bias)
    d.kind = mfield == 0 ? Datum::Kind::zero : Datum::Kind::finite;
    d.m = mfield;
    d.e = 1 - bias(f) - f.mbits;
  } else {  // normal: 1.mfield * 2^(efield - bias)
    d.m = mfield | (std::uint64_t{1} << f.mbits);
    d.e = static_cast<int>(efield) - bias(f) - f.mbits;
  }
  return d;
}

// Encodes m * 2^e (m > 0) in f: round to nearest, ties to even; past the largest finite value
// the result is infinity; below the smallest normal it is subnormal (or zero).
std::uint32_t encode_magnitude(std::uint64_t m, int e, Format f) {
  int msb = 0;
  while ((m >> (msb + 1)) != 0) ++msb;  // m in [2^msb, 2^(msb+1))
  const int k = msb + e;                 // value in [2^k, 2^(k+1))
  const int emin = 1 - bias(f);
  const int q = std::max(k, emin) - f.mbits;  // the exponent of one unit in the last place
  const int shift = q - e;
  std::uint64_t units = 0;  // value / 2^q, rounded to an integer
  if (shift <= 0) {
    units = m << -shift;  // exact
  } else if (shift < 64) {
    units = m >> shift;
    const std::uint64_t rest = m & ((std::uint64_t{1} << shift) - 1u);
    const std::uint64_t half = std::uint64_t{1} << (shift - 1);
    if (rest > half || (rest == half && (units & 1u) != 0)) ++units;
  }  // else: m < 2^63 <= 2^(shift-1), below half a unit: zero
  // Subnormal: the field is the unit count (2^mbits, after rounding up, is the smallest
  // normal). Normal: exponent field, plus the units above the implicit bit; a carry out of
  // the significand moves into the exponent, up to infinity.
  std::uint64_t bits = k < emin ? units : (static_cast<std::uint64_t>(k + bias(f)) << f.mbits) + units - (std::uint64_t{1} << f.mbits);
  if (bits >= inf_bits(f)) bits = inf_bits(f);
  return static_cast<std::uint32_t>(bits);
}

// The correctly rounded conversion of the datum `bits` of format `from` to format `to`; a NaN
// becomes the quiet NaN of its sign with an empty payload (bf16's canonical NaN).
std::uint32_t ref_convert(std::uint32_t bits, Format from, Format to) {
  const Datum d = decode(bits, from);
  const std::uint32_t sign = d.neg ? sign_bit(to) : 0u;
  switch (d.kind) {
    case Datum::Kind::zero: return sign;
    case Datum::Kind::inf: return sign | inf_bits(to);
    case Datum::Kind::nan: return sign | quiet_nan_bits(to);
    case Datum::Kind::finite: break;
  }
  return sign | encode_magnitude(d.m, d.e, to);
}

// =============================================================================================
// Bits of the element types.
// =============================================================================================

template <class T> constexpr Format format_of() {
  if constexpr (std::is_same_v<T, fp32>) return kFp32;
  else if constexpr (std::is_same_v<T, fp16>) return kFp16;
  else return kBf16;
}

template <class T> std::uint32_t bits_of(const T& x) {
  if constexpr (sizeof(T) == 4) {
    std::uint32_t b;
    std::memcpy(&b, static_cast<const void*>(&x), 4);
    return b;
  } else {
    std::uint16_t b;
    std::memcpy(&b, static_cast<const void*>(&x), 2);
    return b;
  }
}

template <class T> T from_bits(std::uint32_t b) {
  T x;
  if constexpr (sizeof(T) == 4) {
    std::memcpy(static_cast<void*>(&x), &b, 4);
  } else {
    const auto h = static_cast<std::uint16_t>(b);
    std::memcpy(static_cast<void*>(&x), &h, 2);
  }
  return x;
}

std::string hex(std::uint32_t v, int digits) {
  std::ostringstream out;
  out << "0x" << std::hex << std::uppercase << std::setw(digits) << std::setfill('0') << v;
  return out.str();
}

// Collects mismatches; reports the first few in full and the count at the end.
//  - the expected value is not a NaN: the bits must be equal;
//  - it is a NaN: the result must be a NaN of the same sign, and with exact_nan the same bits.
class Mismatches {
 public:
  Mismatches(std::string what, Format from, Format to, bool exact_nan)
      : what_(std::move(what)), from_(from), to_(to), exact_nan_(exact_nan) {}
  Mismatches(const Mismatches&) = delete;
  Mismatches& operator=(const Mismatches&) = delete;
  ~Mismatches() { EXPECT_EQ(count_, 0u) << what_ << ": " << count_ << " mismatches in " << checked_ << " values"; }

  void check(std::uint32_t input, std::uint32_t got, std::uint32_t want) {
    ++checked_;
    bool ok = got == want;
    if (!ok && !exact_nan_ && is_nan_bits(want, to_)) {
      ok = is_nan_bits(got, to_) && (got & sign_bit(to_)) == (want & sign_bit(to_));
    }
    if (ok) return;
    if (count_++ < 8) {
      ADD_FAILURE() << what_ << ": input " << hex(input, digits(from_)) << " gave " << hex(got, digits(to_))
                    << ", want " << hex(want, digits(to_)) << (is_nan_bits(want, to_) ? " (a NaN of this sign)" : "");
    }
  }
  std::size_t checked() const { return checked_; }

 private:
  static int digits(Format f) { return (f.ebits + f.mbits + 1) / 4; }
  std::string what_;
  Format from_, to_;
  bool exact_nan_;
  std::size_t checked_ = 0, count_ = 0;
};

// =============================================================================================
// Conversion paths under test.
// =============================================================================================

template <class Tag> constexpr bool compiled_v = false;
template <> constexpr bool compiled_v<isa::scalar> = true;
template <> constexpr bool compiled_v<isa::avx2> = KVATTN_HAS_AVX2 != 0;
template <> constexpr bool compiled_v<isa::avx512> = KVATTN_HAS_AVX512 != 0;
template <> constexpr bool compiled_v<isa::neon> = KVATTN_HAS_NEON != 0;

template <class Tag> std::string not_compiled_reason() {
  std::string why = "isa::" + std::string(Tag::name) + " is not compiled in this translation unit: ";
  if (KVATTN_FORCE_SCALAR) return why + "KVATTN_FORCE_SCALAR is set";
  if constexpr (std::is_same_v<Tag, isa::avx2>) return why + "the compiler does not target AVX2+FMA+F16C (-mavx2 -mfma -mf16c)";
  if constexpr (std::is_same_v<Tag, isa::avx512>)
    return why + "the compiler does not target AVX-512 F/BW/DQ/VL with FMA and F16C (-mavx512f -mavx512bw -mavx512dq -mavx512vl -mfma -mf16c)";
  return why + "the compiler does not target aarch64 with NEON";
}

/// to_float / from_float one element at a time (a type to itself: plain copy).
struct elementwise {
  static constexpr std::string_view name = "elementwise";
  static constexpr bool available = true;
  static std::string why_unavailable() { return {}; }
  template <class S, class D> static void run(const S* src, D* dst, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) {
      if constexpr (std::is_same_v<S, D>) dst[i] = src[i];
      else dst[i] = kvattn::from_float<D>(kvattn::to_float(src[i]));
    }
  }
};

/// The types' own conversions, T(float) and static_cast<float>(T): portable integer code, where
/// to_float / from_float use the instruction set's (F16C on x86-64 with AVX2).
struct members {
  static constexpr std::string_view name = "members";
  static constexpr bool available = true;
  static std::string why_unavailable() { return {}; }
  template <class T> static float widen(T x) { return static_cast<float>(x); }
  template <class S, class D> static void run(const S* src, D* dst, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) {
      if constexpr (std::is_same_v<S, D>) dst[i] = src[i];
      else if constexpr (std::is_same_v<D, float>) dst[i] = widen(src[i]);
      else dst[i] = D(widen(src[i]));
    }
  }
};

/// convert_row(Tag{}, src, dst, n).
template <class Tag> struct bulk {
  static constexpr std::string_view name = Tag::name;
  static constexpr bool available = compiled_v<Tag>;
  static std::string why_unavailable() { return not_compiled_reason<Tag>(); }
  template <class S, class D> static void run(const S* src, D* dst, std::size_t n) {
    kvattn::convert_row(Tag{}, src, dst, n);
  }
};

/// convert_row(src, dst, n): isa::native.
struct native_bulk {
  static constexpr std::string_view name = "native";
  static constexpr bool available = true;
  static std::string why_unavailable() { return {}; }
  template <class S, class D> static void run(const S* src, D* dst, std::size_t n) { kvattn::convert_row(src, dst, n); }
};

// =============================================================================================
// Compile-time checks: traits, and which exact overloads exist.
// =============================================================================================

static_assert(kvattn::storage_traits<fp32>::name == "fp32" && kvattn::storage_traits<fp32>::bits == 32 &&
              kvattn::storage_traits<fp32>::bytes == 4);
static_assert(kvattn::storage_traits<fp16>::name == "fp16" && kvattn::storage_traits<fp16>::bits == 16 &&
              kvattn::storage_traits<fp16>::bytes == 2);
static_assert(kvattn::storage_traits<bf16>::name == "bf16" && kvattn::storage_traits<bf16>::bits == 16 &&
              kvattn::storage_traits<bf16>::bytes == 2);
static_assert(kvattn::storage_traits<fp16>::bytes == sizeof(fp16) && kvattn::storage_traits<bf16>::bytes == sizeof(bf16));
static_assert(kvattn::is_storage_type_v<fp32> && kvattn::is_storage_type_v<fp16> && kvattn::is_storage_type_v<bf16>);
static_assert(!kvattn::is_storage_type_v<double> && !kvattn::is_storage_type_v<std::uint16_t> &&
              !kvattn::is_storage_type_v<int>);
static_assert(std::is_same_v<decltype(kvattn::from_float<fp16>(1.0f)), fp16>);
static_assert(noexcept(kvattn::to_float(std::declval<const fp16&>())) && noexcept(kvattn::from_float<bf16>(0.0f)));

// Does convert_row have an overload taking exactly (Tag, const S*, D*, size_t) noexcept?
// (Taking the address with that exact type succeeds for a non-template overload of that
// signature, or for the scalar template when Tag is isa::scalar, and for nothing else.)
template <class Tag, class S, class D, class = void> struct has_exact_overload : std::false_type {};
template <class Tag, class S, class D>
struct has_exact_overload<Tag, S, D,
                          std::void_t<decltype(static_cast<void (*)(Tag, const S*, D*, std::size_t) noexcept>(
                              &kvattn::convert_row))>> : std::true_type {};

template <class Tag> constexpr bool has_simd_pairs_v =
    has_exact_overload<Tag, fp16, float>::value && has_exact_overload<Tag, float, fp16>::value &&
    has_exact_overload<Tag, bf16, float>::value && has_exact_overload<Tag, float, bf16>::value;
template <class Tag> constexpr bool has_any_simd_pair_v =
    has_exact_overload<Tag, fp16, float>::value || has_exact_overload<Tag, float, fp16>::value ||
    has_exact_overload<Tag, bf16, float>::value || has_exact_overload<Tag, float, bf16>::value;
// Pairs that never have a SIMD overload: they resolve to the scalar template from any tag.
template <class Tag> constexpr bool has_non_simd_pair_v =
    has_exact_overload<Tag, fp16, bf16>::value || has_exact_overload<Tag, bf16, fp16>::value ||
    has_exact_overload<Tag, float, float>::value || has_exact_overload<Tag, fp16, fp16>::value ||
    has_exact_overload<Tag, bf16, bf16>::value;

static_assert(has_simd_pairs_v<isa::scalar> && has_non_simd_pair_v<isa::scalar>, "the scalar template covers every pair");
static_assert(has_simd_pairs_v<isa::avx2> == bool(KVATTN_HAS_AVX2) && has_any_simd_pair_v<isa::avx2> == bool(KVATTN_HAS_AVX2));
static_assert(has_simd_pairs_v<isa::avx512> == bool(KVATTN_HAS_AVX512) &&
              has_any_simd_pair_v<isa::avx512> == bool(KVATTN_HAS_AVX512));
static_assert(has_simd_pairs_v<isa::neon> == bool(KVATTN_HAS_NEON) && has_any_simd_pair_v<isa::neon> == bool(KVATTN_HAS_NEON));
static_assert(!has_non_simd_pair_v<isa::avx2> && !has_non_simd_pair_v<isa::avx512> && !has_non_simd_pair_v<isa::neon>);
// With these overload sets, a call resolves to the most derived tag that has an overload: the
// conversion avx512 -> avx2 ranks above avx512 -> scalar ([over.ics.rank]), so a pair with only
// an avx2 overload uses it, and a pair with no SIMD overload uses the template.
static_assert(std::is_base_of_v<isa::avx2, isa::avx512> && std::is_base_of_v<isa::scalar, isa::avx2> &&
              std::is_base_of_v<isa::scalar, isa::neon>);
static_assert(std::is_same_v<isa::native, isa::avx512> == bool(KVATTN_HAS_AVX512));

// =============================================================================================
// Check drivers (one path, one pair).
// =============================================================================================

template <class Path> std::string label(std::string_view what) { return std::string(Path::name) + ": " + std::string(what); }

/// All 65,536 patterns of a 16-bit type to fp32, then back down (exact for every non-NaN).
template <class Src, class Path> void check_widen_and_round_trip_exhaustive() {
  constexpr Format f = format_of<Src>();
  std::vector<Src> src(65536);
  for (std::uint32_t i = 0; i < 65536; ++i) src[i] = from_bits<Src>(i);
  std::vector<float> wide(src.size());
  Path::run(src.data(), wide.data(), src.size());
  {
    Mismatches mm(label<Path>(kvattn::storage_traits<Src>::name) + " -> fp32, all patterns", f, kFp32, false);
    for (std::uint32_t i = 0; i < 65536; ++i) mm.check(i, bits_of(wide[i]), ref_convert(i, f, kFp32));
  }
  // Back down from the reference's widened values (so that this half stands alone).
  for (std::uint32_t i = 0; i < 65536; ++i) wide[i] = from_bits<float>(ref_convert(i, f, kFp32));
  std::vector<Src> back(src.size());
  Path::run(wide.data(), back.data(), wide.size());
  Mismatches mm(label<Path>(kvattn::storage_traits<Src>::name) + " -> fp32 -> back, all patterns", f, f,
                /*exact_nan=*/std::is_same_v<Src, bf16>);
  for (std::uint32_t i = 0; i < 65536; ++i) {
    const std::uint32_t want = is_nan_bits(i, f) ? ref_convert(i, f, f) : i;  // identity but for NaN
    mm.check(i, bits_of(back[i]), want);
  }
}

/// fp32 -> Dst for `count` inputs gen(0..count-1), in rows of 4093 (odd, so that SIMD steps
/// and tails meet every input position), against the reference.
template <class Dst, class Path, class Gen> void check_narrow(std::string_view what, std::size_t count, Gen gen) {
  constexpr Format f = format_of<Dst>();
  constexpr std::size_t row = 4093;
  Mismatches mm(label<Path>("fp32 -> ") + std::string(kvattn::storage_traits<Dst>::name) + ", " + std::string(what), kFp32,
                f, /*exact_nan=*/std::is_same_v<Dst, bf16>);
  std::vector<std::uint32_t> in_bits(row);
  std::vector<float> in(row);
  std::vector<Dst> out(row);
  for (std::size_t base = 0; base < count; base += row) {
    const std::size_t n = std::min(row, count - base);
    for (std::size_t j = 0; j < n; ++j) {
      in_bits[j] = gen(base + j);
      in[j] = from_bits<float>(in_bits[j]);
    }
    Path::run(in.data(), out.data(), n);
    for (std::size_t j = 0; j < n; ++j) mm.check(in_bits[j], bits_of(out[j]), ref_convert(in_bits[j], kFp32, f));
  }
  EXPECT_EQ(mm.checked(), count);
}

// Rounding-relevant low bits below the kept significand: zero, just above zero, just below a
// half, exactly a half, just above a half, just below one.
constexpr std::uint32_t kLow13[] = {0x0, 0x1, 0xfff, 0x1000, 0x1001, 0x1fff};
constexpr std::uint32_t kLow16[] = {0x0, 0x1, 0x7fff, 0x8000, 0x8001, 0xffff};
constexpr std::uint64_t kStride = 251;
constexpr std::size_t kStridedCount = static_cast<std::size_t>(((std::uint64_t{1} << 32) + kStride - 1) / kStride);

std::vector<std::uint32_t> random_fp32_bits(std::uint32_t seed, std::size_t n, bool near_fp16_range) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<std::uint32_t> exp(127 - 27, 127 + 17);  // fp16: below half its smallest subnormal .. above max
  std::vector<std::uint32_t> v(n);
  for (auto& x : v) {
    x = static_cast<std::uint32_t>(rng());
    if (near_fp16_range) x = (x & 0x807fffffu) | (exp(rng) << 23);
  }
  return v;
}

template <class Dst, class Path> void check_narrow_samples() {
  if constexpr (std::is_same_v<Dst, fp16>) {
    check_narrow<Dst, Path>("every sign|exponent|10 bits x 6 low-13 patterns", (std::size_t{1} << 19) * 6,
                            [](std::size_t i) { return static_cast<std::uint32_t>((i / 6) << 13) | kLow13[i % 6]; });
  } else {
    check_narrow<Dst, Path>("every upper half x 6 low-16 patterns", std::size_t{65536} * 6,
                            [](std::size_t i) { return static_cast<std::uint32_t>((i / 6) << 16) | kLow16[i % 6]; });
  }
  check_narrow<Dst, Path>("every 251st pattern of 2^32", kStridedCount,
                          [](std::size_t i) { return static_cast<std::uint32_t>(i * kStride); });
  const std::vector<std::uint32_t> any = random_fp32_bits(20240601u, std::size_t{1} << 18, false);
  check_narrow<Dst, Path>("seeded random patterns", any.size(), [&](std::size_t i) { return any[i]; });
  const std::vector<std::uint32_t> near = random_fp32_bits(77u, std::size_t{1} << 18, true);
  check_narrow<Dst, Path>("seeded random values near fp16's range", near.size(), [&](std::size_t i) { return near[i]; });
}

// Hand-written expectations (not from the reference), each checked for the reference too.
struct Edge {
  std::uint32_t in;    // fp32 bits
  std::uint32_t want;  // result bits; for a NaN, any NaN of that sign (fp16) or exactly these (bf16)
  const char* what;
};
const std::vector<Edge>& fp16_edges() {
  static const std::vector<Edge> e = {
      {0x00000000, 0x0000, "+0"},
      {0x80000000, 0x8000, "-0"},
      {0x7f800000, 0x7c00, "+inf"},
      {0xff800000, 0xfc00, "-inf"},
      {0x7fc00000, 0x7e00, "+qNaN"},
      {0xffc00000, 0xfe00, "-qNaN"},
      {0x7f800001, 0x7e00, "+sNaN, lowest payload bit only"},
      {0xff800001, 0xfe00, "-sNaN, lowest payload bit only"},
      {0x7fffffff, 0x7e00, "+NaN, all payload bits"},
      {0x3f800000, 0x3c00, "1"},
      {0x3f801000, 0x3c00, "1 + half an ulp: tie to even (down)"},
      {0x3f803000, 0x3c02, "1 + 3 half ulps: tie to even (up)"},
      {0x3f801001, 0x3c01, "just above a tie"},
      {0x477fe000, 0x7bff, "65504, the largest finite"},
      {0xc77fe000, 0xfbff, "-65504"},
      {0x477fefff, 0x7bff, "just below the overflow threshold 65520"},
      {0x477ff000, 0x7c00, "65520: tie between 65504 and 2^16, to even: +inf"},
      {0xc77ff000, 0xfc00, "-65520: -inf"},
      {0x47800000, 0x7c00, "65536"},
      {0x7f7fffff, 0x7c00, "largest fp32"},
      {0x38800000, 0x0400, "2^-14, the smallest normal"},
      {0x387fc000, 0x03ff, "1023 * 2^-24, the largest subnormal"},
      {0x387fe000, 0x0400, "1023.5 * 2^-24: tie between the largest subnormal and the smallest normal, to even"},
      {0x387fdfff, 0x03ff, "just below 1023.5 * 2^-24"},
      {0x387fa000, 0x03fe, "1022.5 * 2^-24: tie between 0x3fe and 0x3ff, to even"},
      {0x33800000, 0x0001, "2^-24, the smallest subnormal"},
      {0xb3800000, 0x8001, "-2^-24"},
      {0x33000000, 0x0000, "2^-25, halfway to the smallest subnormal: to even (zero)"},
      {0xb3000000, 0x8000, "-2^-25: -0"},
      {0x33000001, 0x0001, "just above 2^-25"},
      {0x32ffffff, 0x0000, "just below 2^-25"},
      {0x33c00000, 0x0002, "1.5 * 2^-24: tie, to even (2)"},
      {0x34200000, 0x0002, "2.5 * 2^-24: tie, to even (2)"},
      {0x00000001, 0x0000, "smallest fp32 subnormal"},
      {0x80000001, 0x8000, "-smallest fp32 subnormal"},
      {0x007fffff, 0x0000, "largest fp32 subnormal"},
  };
  return e;
}
const std::vector<Edge>& bf16_edges() {
  static const std::vector<Edge> e = {
      {0x00000000, 0x0000, "+0"},
      {0x80000000, 0x8000, "-0"},
      {0x7f800000, 0x7f80, "+inf"},
      {0xff800000, 0xff80, "-inf"},
      {0x7fc00000, 0x7fc0, "+qNaN"},
      {0xffc00000, 0xffc0, "-qNaN"},
      {0x7f800001, 0x7fc0, "+sNaN, low payload: must not round to inf"},
      {0xff800001, 0xffc0, "-sNaN, low payload"},
      {0x7fffffff, 0x7fc0, "+NaN, all payload bits: must not carry into the sign"},
      {0xffffffff, 0xffc0, "-NaN, all payload bits"},
      {0x7fa00000, 0x7fc0, "+sNaN with a high payload: canonical"},
      {0x3f800000, 0x3f80, "1"},
      {0x3f808000, 0x3f80, "1 + half an ulp: tie to even (down)"},
      {0x3f818000, 0x3f82, "1 + 3 half ulps: tie to even (up)"},
      {0x3f808001, 0x3f81, "just above a tie"},
      {0x3f807fff, 0x3f80, "just below a tie"},
      {0x7f7f0000, 0x7f7f, "the largest finite bf16"},
      {0x7f7f7fff, 0x7f7f, "just below the overflow threshold"},
      {0x7f7f8000, 0x7f80, "the overflow threshold: tie, to even: +inf"},
      {0xff7f8000, 0xff80, "-overflow threshold: -inf"},
      {0x7f7fffff, 0x7f80, "largest fp32: +inf"},
      {0x00800000, 0x0080, "smallest normal"},
      {0x007fffff, 0x0080, "largest fp32 subnormal: rounds up to the smallest normal"},
      {0x00010000, 0x0001, "smallest bf16 subnormal"},
      {0x00008000, 0x0000, "halfway to the smallest subnormal: to even (zero)"},
      {0x80008000, 0x8000, "-halfway to the smallest subnormal: -0"},
      {0x00008001, 0x0001, "just above halfway to the smallest subnormal"},
      {0x00018000, 0x0002, "1.5 smallest subnormals: tie, to even (2)"},
      {0x00000001, 0x0000, "smallest fp32 subnormal"},
  };
  return e;
}

/// Every edge value as a row of 37 copies (full SIMD steps and a tail), per path.
template <class Dst, class Path> void check_edges(const std::vector<Edge>& edges) {
  constexpr Format f = format_of<Dst>();
  constexpr bool exact_nan = std::is_same_v<Dst, bf16>;
  for (const Edge& e : edges) {
    const std::vector<float> in(37, from_bits<float>(e.in));
    std::vector<Dst> out(in.size());
    Path::run(in.data(), out.data(), in.size());
    Mismatches mm(label<Path>("fp32 -> ") + std::string(kvattn::storage_traits<Dst>::name) + ", " + e.what, kFp32, f, exact_nan);
    for (const Dst& o : out) mm.check(e.in, bits_of(o), e.want);
  }
}

/// Bulk on every length 0..70 at several misalignments, against the reference element by
/// element; the elements around dst[0, n) must stay as they were, and src is allocated to its
/// exact size (so that a sanitizer sees a read past its end).
template <class S, class D, class Path> void check_rows_and_guards() {
  constexpr Format fs = format_of<S>(), fd = format_of<D>();
  constexpr std::size_t kGuard = 19;
  const std::uint32_t guard_bits = sizeof(D) == 4 ? 0xA5A5A5A5u : 0xA5A5u;
  // Sources: random patterns in the range where narrowing rounds (ties included), specials.
  std::mt19937 rng(12345u + 7u * sizeof(S) + sizeof(D));
  auto source_bits = [&](std::size_t j) -> std::uint32_t {
    static constexpr std::uint32_t specials32[] = {0x7f800000, 0xff800001, 0x7fffffff, 0x477ff000, 0x33000000, 0x3f808000, 0x00000001, 0x80000000};
    static constexpr std::uint32_t specials16[] = {0x7c00, 0xfe01, 0x7fff, 0x0001, 0x8000, 0x03ff, 0x7f80, 0xff81};
    const std::uint32_t r = static_cast<std::uint32_t>(rng());
    if (j % 7 == 3) return sizeof(S) == 4 ? specials32[r % 8] : specials16[r % 8];
    if constexpr (sizeof(S) == 4) {
      const std::uint32_t exp = 127 - 26 + r % 44;  // around fp16's range
      const std::uint32_t low = (j % 5 == 1) ? ((r >> 8) & 0x807fe000u) | 0x1000u : (r & 0x807fffffu);  // some exact ties
      return (low & 0x807fffffu) | (exp << 23);
    } else {
      return r & 0xffffu;
    }
  };
  for (std::size_t n = 0; n <= 70; ++n) {
    for (std::size_t src_off : {0, 1, 3}) {
      for (std::size_t dst_off : {0, 1, 2}) {
        std::vector<std::uint32_t> in_bits(n);
        std::vector<S> src(src_off + n);
        for (std::size_t j = 0; j < src_off; ++j) src[j] = from_bits<S>(0);
        for (std::size_t j = 0; j < n; ++j) {
          in_bits[j] = source_bits(j);
          src[src_off + j] = from_bits<S>(in_bits[j]);
        }
        std::vector<D> dst(dst_off + n + kGuard, from_bits<D>(guard_bits));
        Path::run(src.data() + src_off, dst.data() + dst_off, n);
        std::ostringstream what;
        what << kvattn::storage_traits<S>::name << " -> " << kvattn::storage_traits<D>::name << ", n=" << n
             << " src+" << src_off << " dst+" << dst_off;
        {
          Mismatches mm(label<Path>(what.str()), fs, fd, /*exact_nan=*/std::is_same_v<S, D> || std::is_same_v<D, bf16>);
          for (std::size_t j = 0; j < n; ++j) {
            const std::uint32_t want = std::is_same_v<S, D> ? in_bits[j] : ref_convert(in_bits[j], fs, fd);
            mm.check(in_bits[j], bits_of(dst[dst_off + j]), want);
          }
        }
        std::size_t clobbered = 0;
        for (std::size_t j = 0; j < dst.size(); ++j) {
          if ((j < dst_off || j >= dst_off + n) && bits_of(dst[j]) != guard_bits) ++clobbered;
        }
        EXPECT_EQ(clobbered, 0u) << label<Path>(what.str()) << ": wrote outside dst[0, n)";
      }
    }
  }
}

template <class Path> void check_all_pairs_rows() {
  check_rows_and_guards<fp16, float, Path>();
  check_rows_and_guards<float, fp16, Path>();
  check_rows_and_guards<bf16, float, Path>();
  check_rows_and_guards<float, bf16, Path>();
  check_rows_and_guards<fp16, bf16, Path>();
  check_rows_and_guards<bf16, fp16, Path>();
  check_rows_and_guards<float, float, Path>();
  check_rows_and_guards<fp16, fp16, Path>();
  check_rows_and_guards<bf16, bf16, Path>();
}

// =============================================================================================
// Tests.
// =============================================================================================

TEST(StorageReference, MatchesKnownValues) {
  // Widening, against values written as fp32 literals / ldexp.
  EXPECT_EQ(ref_convert(0x3c00, kFp16, kFp32), bits_of(1.0f));
  EXPECT_EQ(ref_convert(0xc000, kFp16, kFp32), bits_of(-2.0f));
  EXPECT_EQ(ref_convert(0x7bff, kFp16, kFp32), bits_of(65504.0f));
  EXPECT_EQ(ref_convert(0x0400, kFp16, kFp32), bits_of(std::ldexp(1.0f, -14)));
  EXPECT_EQ(ref_convert(0x0001, kFp16, kFp32), bits_of(std::ldexp(1.0f, -24)));
  EXPECT_EQ(ref_convert(0x03ff, kFp16, kFp32), bits_of(std::ldexp(1023.0f, -24)));
  EXPECT_EQ(ref_convert(0x8000, kFp16, kFp32), 0x80000000u);
  EXPECT_EQ(ref_convert(0xfc00, kFp16, kFp32), 0xff800000u);
  EXPECT_EQ(ref_convert(0x3f80, kBf16, kFp32), bits_of(1.0f));
  EXPECT_EQ(ref_convert(0x0001, kBf16, kFp32), bits_of(std::ldexp(1.0f, -133)));
  EXPECT_EQ(ref_convert(0x7f7f, kBf16, kFp32), 0x7f7f0000u);
  EXPECT_TRUE(is_nan_bits(ref_convert(0x7c01, kFp16, kFp32), kFp32));
  EXPECT_EQ(ref_convert(0xfd00, kFp16, kFp32), 0xffc00000u);
  // Narrowing: the hand tables.
  for (const Edge& e : fp16_edges()) EXPECT_EQ(ref_convert(e.in, kFp32, kFp16), e.want) << e.what;
  for (const Edge& e : bf16_edges()) EXPECT_EQ(ref_convert(e.in, kFp32, kBf16), e.want) << e.what;
  // Every fp16 value and its neighbours' midpoints, computed a second way (fp64 arithmetic).
  for (std::uint32_t h = 0; h < 0x7c00; ++h) {
    const double v = h < 0x400 ? std::ldexp(double(h), -24) : std::ldexp(1.0 + (h & 0x3ff) / 1024.0, int(h >> 10) - 15);
    ASSERT_EQ(ref_convert(h, kFp16, kFp32), bits_of(static_cast<float>(v))) << hex(h, 4);
    ASSERT_EQ(ref_convert(bits_of(static_cast<float>(v)), kFp32, kFp16), h) << hex(h, 4);
  }
}

TEST(StorageTypes, ElementWiseConveniences) {
  EXPECT_EQ(kvattn::to_float(1.5f), 1.5f);
  EXPECT_EQ(kvattn::to_float(kvattn::from_float<fp16>(-0.375f)), -0.375f);
  EXPECT_EQ(kvattn::to_float(kvattn::from_float<bf16>(3.0f)), 3.0f);
  EXPECT_EQ(bits_of(kvattn::from_float<fp16>(1.0f)), 0x3c00u);
  EXPECT_EQ(bits_of(kvattn::from_float<bf16>(1.0f)), 0x3f80u);
  EXPECT_EQ(bits_of(kvattn::from_float<fp32>(-2.0f)), bits_of(-2.0f));
}

TEST(StorageDispatch, ReportsNativeIsa) {
  std::ostringstream line;
  line << "kvattn native ISA: " << isa::native::name << " (KVATTN_HAS_AVX2=" << KVATTN_HAS_AVX2
       << " KVATTN_HAS_AVX512=" << KVATTN_HAS_AVX512 << " KVATTN_HAS_NEON=" << KVATTN_HAS_NEON
       << " KVATTN_FORCE_SCALAR=" << KVATTN_FORCE_SCALAR << ")";
  std::cout << line.str() << std::endl;
  RecordProperty("native_isa", std::string(isa::native::name));
  EXPECT_EQ(isa::native::name == "scalar", !(KVATTN_HAS_AVX2 || KVATTN_HAS_AVX512 || KVATTN_HAS_NEON));
}

// A richer tag than this translation unit has (or one of another architecture) falls back to
// the nearest base that has an overload, and gives the same results: every pair, every tag.
template <class Tag> void check_tag_resolves_for_all_pairs() {
  check_all_pairs_rows<bulk<Tag>>();  // bulk<Tag>::run calls convert_row(Tag{}, ...) whatever it resolves to
}
TEST(StorageDispatch, RicherTagsFallBackToNearestBase) {
  check_tag_resolves_for_all_pairs<isa::avx512>();
  check_tag_resolves_for_all_pairs<isa::avx2>();
  check_tag_resolves_for_all_pairs<isa::neon>();
}

template <class Path> class StoragePath : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!Path::available) GTEST_SKIP() << Path::why_unavailable();
  }
};

using Paths = ::testing::Types<elementwise, members, bulk<isa::scalar>, bulk<isa::avx2>, bulk<isa::avx512>, bulk<isa::neon>, native_bulk>;
struct PathName {
  template <class Path> static std::string GetName(int) { return std::string(Path::name); }
};
TYPED_TEST_SUITE(StoragePath, Paths, PathName);

TYPED_TEST(StoragePath, Fp16ToFp32AndBackExhaustive) { check_widen_and_round_trip_exhaustive<fp16, TypeParam>(); }
TYPED_TEST(StoragePath, Bf16ToFp32AndBackExhaustive) { check_widen_and_round_trip_exhaustive<bf16, TypeParam>(); }
TYPED_TEST(StoragePath, Fp32ToFp16Samples) { check_narrow_samples<fp16, TypeParam>(); }
TYPED_TEST(StoragePath, Fp32ToBf16Samples) { check_narrow_samples<bf16, TypeParam>(); }
TYPED_TEST(StoragePath, Fp32ToFp16EdgeCases) { check_edges<fp16, TypeParam>(fp16_edges()); }
TYPED_TEST(StoragePath, Fp32ToBf16EdgeCases) { check_edges<bf16, TypeParam>(bf16_edges()); }
TYPED_TEST(StoragePath, EveryPairEveryLengthMisalignedWithGuards) { check_all_pairs_rows<TypeParam>(); }

}  // namespace
