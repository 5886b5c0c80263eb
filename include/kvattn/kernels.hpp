// kvattn/kernels.hpp — the compiled kernels: decode, prefill and MLA decode built once per
// instruction set into the kvattn::kernels library, the best one this CPU runs chosen at first use.
//
// The header-only operators (kvattn/decode.hpp, prefill.hpp, mla_decode.hpp) are instantiated by
// every translation unit that calls them, for the instruction set of that unit's flags. The
// compiled kernels are the other way in: the library (CMake target kvattn::kernels, built from
// kvattn's src/) compiles each configuration listed below once for every instruction set kvattn
// has code for on the target architecture (x86-64: scalar, AVX2, AVX-512; aarch64: scalar,
// NEON), and a unit that calls them includes this header alone, instantiates no kernel, and runs
// on any CPU of the architecture at its best speed.
//
//   kernels::decode(view, q, out, lse, plan, pf, policy)       as kvattn::decode
//   kernels::prefill(cache, layer, q, k, v, out, lse, plan, pf, policy)
//                                                               as kvattn::prefill (a cache of host memory)
//   kernels::mla_decode(view, q, out, lse, plan, pf, policy)   as kvattn::mla_decode
//                                  each through the chosen instruction set's kernels
//   kernels::isa()          the instruction set the kernels run: chosen at first use, the best
//                           that this CPU runs and the library has, or the one the environment
//                           variable KVATTN_ISA names ("scalar", "avx2", "avx512", "neon")
//   kernels::set_isa(name)  chooses one (or "best"); kernels::isas() lists those there are
//
// Shapes, plans and policies are the header-only operators' (kvattn/core.hpp, policy.hpp): a
// plan made with DecodePlan::make or PrefillPlan::make serves either way in. The compiled
// configurations are, per operator, every pair of the formats and the policies listed below, at
// every head size; calling another is a compile-time error that names the list.
#pragma once

#include <cstddef>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "core.hpp"
#include "paged_cache.hpp"
#include "parallel.hpp"
#include "policy.hpp"

namespace kvattn {
namespace kernels {

/// A list of types, for the configurations the library compiles.
template <class... T> struct type_list {
  static constexpr std::size_t size = sizeof...(T);
};

/// The formats and the policies each operator is compiled for: every pair of them. Decode's
/// policies are the variants of the common models' layers, each type exactly as listed (policy.hpp):
/// SoftCap and Compose<SlidingWindow, SoftCap> are Gemma 2's global and local layers, Sinks and
/// Compose<SlidingWindow, Sinks> gpt-oss's, SlidingWindow Mistral's, Alibi BLOOM's and MPT's.
using decode_formats = type_list<fp16, bf16>;
using decode_policies = type_list<Plain, SlidingWindow, SoftCap, Sinks, Alibi, Compose<SlidingWindow, SoftCap>,
                                  Compose<SlidingWindow, Sinks>>;
using prefill_formats = type_list<fp16, bf16>;
using prefill_policies = type_list<Plain, SlidingWindow>;
using mla_decode_formats = type_list<bf16, fp8_e4m3_latent>;
using mla_decode_policies = type_list<Plain>;

namespace detail {
template <class T, class List> struct index_of;
template <class T> struct index_of<T, type_list<>> {
  static constexpr int value = -1;
};
template <class T, class Head, class... Tail> struct index_of<T, type_list<Head, Tail...>> {
  static constexpr int rest = index_of<T, type_list<Tail...>>::value;
  static constexpr int value = std::is_same_v<T, Head> ? 0 : rest < 0 ? -1 : rest + 1;
};

/// One operator's configurations: every pair of Formats and Policies, a slot each in a Table,
/// formats major, policies minor.
template <class Formats, class Policies> struct Configs {
  static constexpr std::size_t size = Formats::size * Policies::size;
  template <class T, class P>
  static constexpr bool has = index_of<T, Formats>::value >= 0 && index_of<P, Policies>::value >= 0;
  template <class T, class P> static constexpr int slot() {
    return index_of<T, Formats>::value * static_cast<int>(Policies::size) + index_of<P, Policies>::value;
  }
};
using DecodeConfigs = Configs<decode_formats, decode_policies>;
using PrefillConfigs = Configs<prefill_formats, prefill_policies>;
using MlaDecodeConfigs = Configs<mla_decode_formats, mla_decode_policies>;

/// The operators' signatures in the library: the headers', with the parallel-for passed by
/// reference.
template <class T, class P>
using DecodeFn = void (*)(const PagedKvView<T>&, const float*, float*, float*, DecodePlan&, ParallelForRef, const P&);
template <class T, class P>
using PrefillFn = void (*)(PagedKvCache<T>&, int, const float*, const float*, const float*, float*, float*, PrefillPlan&,
                           ParallelForRef, const P&);
template <class T, class P> using MlaDecodeFn = DecodeFn<T, P>;

/// One instruction set's kernels: what each of the library's per-ISA objects exports. Each entry
/// is the operator's function for its slot (Configs::slot), stored as void (*)().
struct Table {
  using Entry = void (*)();
  std::string_view isa;
  Entry decode[DecodeConfigs::size];
  Entry prefill[PrefillConfigs::size];
  Entry mla_decode[MlaDecodeConfigs::size];
};

/// Calls the entry of configuration (T, P) among one operator's `entries`, as a function of type Fn.
template <class Fn, class Configs, class T, class P, class... Args>
void call(const Table::Entry* entries, Args&&... args) {
  reinterpret_cast<Fn>(entries[Configs::template slot<T, P>()])(std::forward<Args>(args)...);
}

/// The table of the instruction set chosen (at the first call, thread-safe; kernels::isa()).
const Table& table();
}  // namespace detail

/// Whether each operator is compiled for format T and policy P.
template <class T, class P> inline constexpr bool decode_compiled = detail::DecodeConfigs::has<T, P>;
template <class T, class P> inline constexpr bool prefill_compiled = detail::PrefillConfigs::has<T, P>;
template <class T, class P> inline constexpr bool mla_decode_compiled = detail::MlaDecodeConfigs::has<T, P>;

/// kvattn::decode (kvattn/decode.hpp: its shapes, checks and errors) through the compiled kernels
/// of kernels::isa(). `pf` is any parallel-for, passed by reference (ParallelForRef; the default
/// runs on the calling thread).
template <class T, class P = Plain>
void decode(const PagedKvView<T>& kv, const float* q, float* out, float* lse, DecodePlan& plan, ParallelForRef pf = {},
            const P& policy = P{}) {
  static_assert(decode_compiled<T, P>,
                "kvattn::kernels::decode: this format and policy are not among the compiled kernels "
                "(kernels::decode_formats and decode_policies in kvattn/kernels.hpp); call kvattn::decode "
                "(kvattn/decode.hpp), which instantiates any");
  detail::call<detail::DecodeFn<T, P>, detail::DecodeConfigs, T, P>(detail::table().decode, kv, q, out, lse, plan, pf, policy);
}

/// kvattn::prefill (kvattn/prefill.hpp: its shapes, checks and errors) of a cache of host memory
/// through the compiled kernels of kernels::isa(); `pf` as for decode.
template <class T, class P = Plain>
void prefill(PagedKvCache<T>& cache, int layer, const float* q, const float* k, const float* v, float* out, float* lse,
             PrefillPlan& plan, ParallelForRef pf = {}, const P& policy = P{}) {
  static_assert(prefill_compiled<T, P>,
                "kvattn::kernels::prefill: this format and policy are not among the compiled kernels "
                "(kernels::prefill_formats and prefill_policies in kvattn/kernels.hpp); call kvattn::prefill "
                "(kvattn/prefill.hpp), which instantiates any");
  detail::call<detail::PrefillFn<T, P>, detail::PrefillConfigs, T, P>(detail::table().prefill, cache, layer, q, k, v, out, lse,
                                                                     plan, pf, policy);
}

/// kvattn::mla_decode (kvattn/mla_decode.hpp: its shapes, checks and errors) through the compiled
/// kernels of kernels::isa(); `pf` as for decode.
template <class T, class P = Plain>
void mla_decode(const PagedKvView<T>& kv, const float* q, float* out, float* lse, DecodePlan& plan, ParallelForRef pf = {},
                const P& policy = P{}) {
  static_assert(mla_decode_compiled<T, P>,
                "kvattn::kernels::mla_decode: this format and policy are not among the compiled kernels "
                "(kernels::mla_decode_formats and mla_decode_policies in kvattn/kernels.hpp); call "
                "kvattn::mla_decode (kvattn/mla_decode.hpp), which instantiates any");
  detail::call<detail::MlaDecodeFn<T, P>, detail::MlaDecodeConfigs, T, P>(detail::table().mla_decode, kv, q, out, lse, plan, pf,
                                                                         policy);
}

/// The instruction set the compiled kernels run ("scalar", "avx2", "avx512", "neon"). Chosen at
/// the first call of this or of a kernel: the one KVATTN_ISA names if it is set (an error if this
/// CPU cannot run it or the library does not have it), else the best of isas().
std::string_view isa();

/// The instruction sets the library has kernels for and this CPU runs, best first.
std::vector<std::string_view> isas();

/// Makes `name` (one of isas(), or "best" for the first of them) the instruction set of every
/// later call. Throws kvattn::invalid_argument naming `name` and isas() if it is neither; the
/// choice is then unchanged. Not to be called while a kernel runs on another thread.
void set_isa(std::string_view name);

}  // namespace kernels
}  // namespace kvattn
