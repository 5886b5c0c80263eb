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

#include "policy_checks.hpp"

#include <cstddef>
#include <cstdint>

namespace isa_kernels {

/// The score policy, chosen at run time here and mapped to kvattn's policy types: the plain
/// kernel, the window, the soft-cap, both, and every hook at once (All).
enum class Policy { plain, window, soft_cap, window_soft_cap, all };
using All = kvattn::Compose<kvattn::SlidingWindow, kvattn::SoftCap, kvattn::Alibi, kvattn::Sinks, kvattn::TreeMask>;

template <class P> struct PolicyTag {
  using type = P;
};
/// Calls fn(PolicyTag<P>{}) for the policy type `which` names.
template <class Fn> void with_policy(Policy which, Fn&& fn) {
  switch (which) {
    case Policy::plain: fn(PolicyTag<kvattn::Plain>{}); break;
    case Policy::window: fn(PolicyTag<kvattn::SlidingWindow>{}); break;
    case Policy::soft_cap: fn(PolicyTag<kvattn::SoftCap>{}); break;
    case Policy::window_soft_cap: fn(PolicyTag<kvattn::Compose<kvattn::SlidingWindow, kvattn::SoftCap>>{}); break;
    case Policy::all: fn(PolicyTag<All>{}); break;
  }
}

/// Formats whose kernels are instantiated here for the plain policy only (Kernels::decode and
/// prefill then take Policy::plain alone): the block-scaled ones (q4_block), whose blocks' scales
/// are applied as a row is loaded, before anything a policy sees, so that the other policies'
/// kernels would check nothing the 16-bit formats' do not, at most of a file's compile time.
template <class T> inline constexpr bool kPlainOnly = kvattn::format_traits<T>::block_scale;

/// The kernels for instruction set Isa (kvattn::isa::avx2 or avx512) and storage type T, with the
/// policy `which` made from `values` (policy_checks::make). `pool` null: kvattn::SerialFor;
/// otherwise the work runs on it (and the plan is made for its threads).
template <class Isa, class T> struct Kernels {
  /// kvattn::decode(view, q, out, lse, plan, ..., policy, Isa{}), the plan made of `params`.
  static void decode(const kvattn::PagedKvView<T>& view, const kvattn::GqaShape& shape, const float* q, float* out,
                     float* lse, const kvattn::DecodeParams& params, Policy which, const policy_checks::Values& values,
                     kvattn::ThreadPool* pool);
  /// kvattn::prefill(..., policy, Isa{}) of the last n tokens of `seq` (appended already) in layer 0:
  /// q [n][q_heads][head_dim], k and v [n][kv_heads][head_dim], out like q, lse [n][q_heads].
  static void prefill(kvattn::PagedKvCache<T>& cache, kvattn::SeqId seq, std::int64_t n, const kvattn::GqaShape& shape,
                      const float* q, const float* k, const float* v, float* out, float* lse,
                      const kvattn::PrefillParams& params, Policy which, const policy_checks::Values& values,
                      kvattn::ThreadPool* pool);
  /// kvattn::mla_decode(view, q, out, lse, plan, ..., policy, Isa{}).
  static void mla_decode(const kvattn::PagedKvView<T>& view, const kvattn::MlaShape& shape, const float* q, float* out,
                         float* lse, const kvattn::DecodeParams& params, Policy which, const policy_checks::Values& values,
                         kvattn::ThreadPool* pool);
  /// kvattn::convert_row(Isa{}, ...): src [n] -> dst [n], T to fp32 and fp32 to T.
  static void widen(const T* src, float* dst, std::size_t n) noexcept;
  static void narrow(const float* src, T* dst, std::size_t n) noexcept;
};

/// kvattn::apply_rope(rope, x, tokens, heads, positions, Isa{}): x [tokens][heads][head_dim].
template <class Isa>
void apply_rope(const kvattn::Rope& rope, float* x, std::int64_t tokens, int heads, const std::int64_t* positions) noexcept;

}  // namespace isa_kernels
