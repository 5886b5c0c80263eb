// kvattn/kernels.hpp — the compiled kernels: decode built once per instruction set into the
// kvattn::kernels library, the best one this CPU runs chosen at first use.
//
// The header-only operators (kvattn/decode.hpp) are instantiated by every translation unit that
// calls them, for the instruction set of that unit's flags. The compiled kernels are the other
// way in: the library (CMake target kvattn::kernels, built from kvattn's src/) compiles each
// configuration listed below once for every instruction set kvattn has code for on the target
// architecture (x86-64: scalar, AVX2, AVX-512; aarch64: scalar, NEON), and a unit that calls
// them includes this header alone, instantiates no kernel, and runs on any CPU of the
// architecture at its best speed.
//
//   kernels::decode(view, q, out, lse, plan, pf, policy)   as kvattn::decode, through the
//                                                           chosen instruction set's kernels
//   kernels::isa()          the instruction set the kernels run: chosen at first use, the best
//                           that this CPU runs and the library has, or the one the environment
//                           variable KVATTN_ISA names ("scalar", "avx2", "avx512", "neon")
//   kernels::set_isa(name)  chooses one (or "best"); kernels::isas() lists those there are
//
// Shapes, plans and policies are the header-only operators' (kvattn/core.hpp, policy.hpp): a
// plan made with DecodePlan::make serves either way in. The compiled configurations are the
// formats in kernels::decode_formats × the policies in kernels::decode_policies, every head
// size; calling another is a compile-time error that names this list.
#pragma once

#include <cstddef>
#include <string_view>
#include <type_traits>
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

/// The formats and the policies decode is compiled for: every pair of them.
using decode_formats = type_list<fp16, bf16>;
using decode_policies = type_list<Plain, SlidingWindow>;

namespace detail {
template <class T, class List> struct index_of;
template <class T> struct index_of<T, type_list<>> {
  static constexpr int value = -1;
};
template <class T, class Head, class... Tail> struct index_of<T, type_list<Head, Tail...>> {
  static constexpr int rest = index_of<T, type_list<Tail...>>::value;
  static constexpr int value = std::is_same_v<T, Head> ? 0 : rest < 0 ? -1 : rest + 1;
};

/// decode's signature in the library: the header's, with the parallel-for passed by reference.
template <class T, class P>
using DecodeFn = void (*)(const PagedKvView<T>&, const float*, float*, float*, DecodePlan&, ParallelForRef, const P&);
/// The slot of decode<T, P> in a Table: formats major, policies minor.
template <class T, class P> constexpr int decode_slot() {
  return index_of<T, decode_formats>::value * static_cast<int>(decode_policies::size) + index_of<P, decode_policies>::value;
}

/// One instruction set's kernels: what each of the library's per-ISA objects exports.
struct Table {
  std::string_view isa;
  void (*decode[decode_formats::size * decode_policies::size])();  // DecodeFn<T, P>, by decode_slot
};

/// The table of the instruction set chosen (at the first call, thread-safe; kernels::isa()).
const Table& table();
}  // namespace detail

/// Whether decode<T, P> is among the compiled kernels.
template <class T, class P>
inline constexpr bool decode_compiled =
    detail::index_of<T, decode_formats>::value >= 0 && detail::index_of<P, decode_policies>::value >= 0;

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
  using Fn = detail::DecodeFn<T, P>;
  reinterpret_cast<Fn>(detail::table().decode[detail::decode_slot<T, P>()])(kv, q, out, lse, plan, pf, policy);
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
