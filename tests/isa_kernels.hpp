// tests/isa_kernels.hpp — kvattn's kernels compiled for one x86-64 instruction set each, for a
// test program built for the x86-64 baseline that calls them only where the CPU has that set.
//
// Declarations only. isa_kernels_impl.hpp defines them; isa_kernels_avx2*.cpp (-march=x86-64-v3)
// and isa_kernels_avx512*.cpp (-march=x86-64-v4) include it and instantiate it for their tag,
// a storage type per file. The test program holds no other copy of these functions, so none of their
// machine code runs before it has asked the CPU.
//
// The callers own everything that is not a kernel (caches, thread pools, buffers): those are
// built in the test's own translation unit, for the baseline, so the instructions that run
// before the CPU has been asked are the baseline's.
#pragma once

#include <kvattn/decode.hpp>
#include <kvattn/mla_decode.hpp>
#include <kvattn/parallel.hpp>
#include <kvattn/prefill.hpp>
#include <kvattn/rope.hpp>

#include <cstddef>
#include <cstdint>

namespace isa_kernels {

/// The attention variant, chosen at run time here and mapped to kvattn's compile-time Variant.
struct Variant {
  bool sliding_window = false;
  bool soft_cap = false;
};

/// The kernels for instruction set Isa (kvattn::isa::avx2 or avx512) and storage type T.
/// `pool` null: kvattn::SerialFor; otherwise the work runs on it.
template <class Isa, class T> struct Kernels {
  /// kvattn::decode<Variant<...>>(view, shape, q, out, lse, params, ..., Isa{}).
  static void decode(const kvattn::PagedKvView<T>& view, const kvattn::GqaShape& shape, const float* q, float* out,
                     float* lse, const kvattn::DecodeParams& params, Variant variant, kvattn::ThreadPool* pool);
  /// kvattn::prefill<Variant<...>>(..., Isa{}) of the last n tokens of `seq` (appended already)
  /// in layer 0: q [n][q_heads][head_dim], k and v [n][kv_heads][head_dim], out like q,
  /// lse [n][q_heads].
  static void prefill(kvattn::PagedKvCache<T>& cache, kvattn::SeqId seq, std::int64_t n, const kvattn::GqaShape& shape,
                      const float* q, const float* k, const float* v, float* out, float* lse,
                      const kvattn::PrefillParams& params, Variant variant, kvattn::ThreadPool* pool);
  /// kvattn::mla_decode(view, shape, q, out, lse, params, ..., Isa{}).
  static void mla_decode(const kvattn::PagedKvView<T>& view, const kvattn::MlaShape& shape, const float* q, float* out,
                         float* lse, const kvattn::MlaDecodeParams& params, kvattn::ThreadPool* pool);
  /// kvattn::convert_row(Isa{}, ...): src [n] -> dst [n], T to fp32 and fp32 to T.
  static void widen(const T* src, float* dst, std::size_t n) noexcept;
  static void narrow(const float* src, T* dst, std::size_t n) noexcept;
};

/// kvattn::apply_rope(rope, x, tokens, heads, positions, Isa{}): x [tokens][heads][head_dim].
template <class Isa>
void apply_rope(const kvattn::Rope& rope, float* x, std::int64_t tokens, int heads, const std::int64_t* positions) noexcept;

}  // namespace isa_kernels
