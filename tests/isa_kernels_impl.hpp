// tests/isa_kernels_impl.hpp — the definitions of isa_kernels.hpp. Included only by the
// translation units that instantiate them for one instruction set (isa_kernels_avx2*.cpp,
// isa_kernels_avx512*.cpp); see isa_kernels.hpp for why nothing else may include it.
#pragma once

#include "isa_kernels.hpp"

#include <vector>

namespace isa_kernels {

namespace detail {
template <bool W, bool C, class Fn> void with_variant(Fn&& fn) { fn(kvattn::Variant<W, C>{}); }
/// Calls fn(kvattn::Variant<W, C>{}) for the variant chosen at run time.
template <class Fn> void with_variant(Variant v, Fn&& fn) {
  if (v.sliding_window && v.soft_cap) with_variant<true, true>(fn);
  else if (v.sliding_window) with_variant<true, false>(fn);
  else if (v.soft_cap) with_variant<false, true>(fn);
  else with_variant<false, false>(fn);
}
}  // namespace detail

template <class Isa, class T>
void Kernels<Isa, T>::decode(const kvattn::PagedKvView<T>& view, const kvattn::GqaShape& shape, const float* q, float* out,
                             float* lse, const kvattn::DecodeParams& params, Variant variant, kvattn::ThreadPool* pool) {
  kvattn::DecodeWorkspace ws;
  detail::with_variant(variant, [&](auto v) {
    using V = decltype(v);
    if (pool != nullptr) kvattn::decode<V>(view, shape, q, out, lse, params, ws, *pool, Isa{});
    else kvattn::decode<V>(view, shape, q, out, lse, params, ws, kvattn::SerialFor{}, Isa{});
  });
}

template <class Isa, class T>
void Kernels<Isa, T>::prefill(kvattn::PagedKvCache<T>& cache, kvattn::SeqId seq, std::int64_t n, const kvattn::GqaShape& shape,
                              const float* q, const float* k, const float* v, float* out, float* lse,
                              const kvattn::PrefillParams& params, Variant variant, kvattn::ThreadPool* pool) {
  kvattn::PrefillWorkspace ws;
  const std::int64_t indptr[2] = {0, n};
  const std::vector<kvattn::SeqId> seqs = {seq};
  detail::with_variant(variant, [&](auto var) {
    using V = decltype(var);
    if (pool != nullptr) kvattn::prefill<V>(cache, 0, seqs, indptr, shape, q, k, v, out, lse, params, ws, *pool, Isa{});
    else kvattn::prefill<V>(cache, 0, seqs, indptr, shape, q, k, v, out, lse, params, ws, kvattn::SerialFor{}, Isa{});
  });
}

template <class Isa, class T>
void Kernels<Isa, T>::mla_decode(const kvattn::PagedKvView<T>& view, const kvattn::MlaShape& shape, const float* q, float* out,
                                 float* lse, const kvattn::MlaDecodeParams& params, kvattn::ThreadPool* pool) {
  kvattn::MlaDecodeWorkspace ws;
  if (pool != nullptr) kvattn::mla_decode(view, shape, q, out, lse, params, ws, *pool, Isa{});
  else kvattn::mla_decode(view, shape, q, out, lse, params, ws, kvattn::SerialFor{}, Isa{});
}

template <class Isa, class T> void Kernels<Isa, T>::widen(const T* src, float* dst, std::size_t n) noexcept {
  kvattn::convert_row(Isa{}, src, dst, n);
}

template <class Isa, class T> void Kernels<Isa, T>::narrow(const float* src, T* dst, std::size_t n) noexcept {
  kvattn::convert_row(Isa{}, src, dst, n);
}

template <class Isa>
void apply_rope(const kvattn::Rope& rope, float* x, std::int64_t tokens, int heads, const std::int64_t* positions) noexcept {
  kvattn::apply_rope(rope, x, tokens, heads, positions, Isa{});
}

}  // namespace isa_kernels
