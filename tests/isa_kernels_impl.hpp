// tests/isa_kernels_impl.hpp — the definitions of isa_kernels.hpp. Included only by the
// translation units that instantiate them for one instruction set (isa_kernels_avx2*.cpp,
// isa_kernels_avx512*.cpp); see isa_kernels.hpp for why nothing else may include it.
#pragma once

#include "isa_kernels.hpp"

#include <stdexcept>
#include <vector>

namespace isa_kernels {

namespace detail {
/// Runs fn(pf) with the parallel-for of `pool` (or SerialFor).
template <class Fn> void with_pool(kvattn::ThreadPool* pool, Fn&& fn) {
  if (pool != nullptr) fn(*pool);
  else fn(kvattn::SerialFor{});
}
}  // namespace detail

template <class Isa, class T>
void Kernels<Isa, T>::decode(const kvattn::PagedKvView<T>& view, const kvattn::GqaShape& shape, const float* q, float* out,
                             float* lse, const kvattn::DecodeParams& params, Policy which, const policy_checks::Values& values,
                             kvattn::ThreadPool* pool) {
  kvattn::DecodePlan plan;
  const auto run = [&](auto tag) {
    using P = typename decltype(tag)::type;
    detail::with_pool(pool, [&](auto&& pf) {
      plan.make(view, shape, params, pf);
      kvattn::decode(view, q, out, lse, plan, pf, policy_checks::make<P>(values), Isa{});
    });
  };
  if constexpr (kPlainOnly<T>) {
    if (which != Policy::plain) throw std::logic_error("isa_kernels: this format's decode is instantiated for the plain policy only");
    run(PolicyTag<kvattn::Plain>{});
  } else {
    with_policy(which, run);
  }
}

template <class Isa, class T>
void Kernels<Isa, T>::prefill(kvattn::PagedKvCache<T>& cache, kvattn::SeqId seq, std::int64_t n, const kvattn::GqaShape& shape,
                              const float* q, const float* k, const float* v, float* out, float* lse,
                              const kvattn::PrefillParams& params, Policy which, const policy_checks::Values& values,
                              kvattn::ThreadPool* pool) {
  kvattn::PrefillPlan plan;
  const auto run = [&](auto tag) {
    using P = typename decltype(tag)::type;
    detail::with_pool(pool, [&](auto&& pf) {
      plan.make(cache, {{seq, n}}, shape, params, pf);
      kvattn::prefill(cache, 0, q, k, v, out, lse, plan, pf, policy_checks::make<P>(values), Isa{});
    });
  };
  if constexpr (kPlainOnly<T>) {
    if (which != Policy::plain) throw std::logic_error("isa_kernels: this format's prefill is instantiated for the plain policy only");
    run(PolicyTag<kvattn::Plain>{});
  } else {
    with_policy(which, run);
  }
}

template <class Isa, class T>
void Kernels<Isa, T>::mla_decode(const kvattn::PagedKvView<T>& view, const kvattn::MlaShape& shape, const float* q, float* out,
                                 float* lse, const kvattn::DecodeParams& params, Policy which,
                                 const policy_checks::Values& values, kvattn::ThreadPool* pool) {
  kvattn::DecodePlan plan;
  with_policy(which, [&](auto tag) {
    using P = typename decltype(tag)::type;
    detail::with_pool(pool, [&](auto&& pf) {
      plan.make(view, shape, params, pf);
      kvattn::mla_decode(view, q, out, lse, plan, pf, policy_checks::make<P>(values), Isa{});
    });
  });
}

template <class Isa, class T> void Kernels<Isa, T>::widen(const T* src, float* dst, std::size_t n) noexcept {
  kvattn::convert_row(Isa{}, src, dst, n);
}
template <class Isa, class T> void Kernels<Isa, T>::narrow(const float* src, T* dst, std::size_t n) noexcept {
  kvattn::convert_row(Isa{}, src, dst, n);
}

/// Explicit instantiations, for instruction set ISA and format T, of the kernels that take the
/// quantized formats: decode and prefill (MLA caches and convert_row do not take them).
#define ISA_KERNELS_INSTANTIATE_QUANTIZED(ISA, T)                                                                     \
  template void isa_kernels::Kernels<ISA, T>::decode(const kvattn::PagedKvView<T>&, const kvattn::GqaShape&, const float*, \
                                                     float*, float*, const kvattn::DecodeParams&, isa_kernels::Policy,   \
                                                     const policy_checks::Values&, kvattn::ThreadPool*);                 \
  template void isa_kernels::Kernels<ISA, T>::prefill(kvattn::PagedKvCache<T>&, kvattn::SeqId, std::int64_t,             \
                                                      const kvattn::GqaShape&, const float*, const float*, const float*, \
                                                      float*, float*, const kvattn::PrefillParams&, isa_kernels::Policy, \
                                                      const policy_checks::Values&, kvattn::ThreadPool*);

template <class Isa>
void apply_rope(const kvattn::Rope& rope, float* x, std::int64_t tokens, int heads, const std::int64_t* positions) noexcept {
  kvattn::apply_rope(rope, x, tokens, heads, positions, Isa{});
}

}  // namespace isa_kernels
