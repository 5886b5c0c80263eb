// src/kernels/isa_kernels.cpp — one instruction set's compiled kernels (kvattn/kernels.hpp).
//
// Compiled once per instruction set, with that set's flags and KVATTN_KERNELS_ISA naming it
// (scalar, avx2, avx512, neon); exports one function, kvattn_kernels_table_<isa>, which the
// dispatcher (dispatch.cpp) calls only after checking that the CPU runs the set. The build makes
// every other symbol of the object local (CMakeLists.txt: kvattn_localize_kernels), so no inline
// function compiled here can stand in for another unit's copy.
#include <kvattn/decode.hpp>
#include <kvattn/kernels.hpp>
#include <kvattn/mla_decode.hpp>
#include <kvattn/prefill.hpp>

#if !defined(KVATTN_KERNELS_ISA)
#error "KVATTN_KERNELS_ISA must name the instruction set this unit is compiled for"
#endif
static_assert(std::is_same_v<kvattn::isa::native, kvattn::isa::KVATTN_KERNELS_ISA>,
              "the flags of this unit do not select the instruction set KVATTN_KERNELS_ISA names");

namespace kvattn::kernels::detail {
namespace {

// The operators, for this unit's instruction set, with the library's signatures (kernels.hpp).
template <class T, class P>
void decode_kernel(const PagedKvView<T>& kv, const float* q, float* out, float* lse, DecodePlan& plan, ParallelForRef pf,
                   const P& policy) {
  kvattn::decode(kv, q, out, lse, plan, pf, policy, isa::native{});
}
template <class T, class P>
void prefill_kernel(PagedKvCache<T>& cache, int layer, const float* q, const float* k, const float* v, float* out, float* lse,
                    PrefillPlan& plan, ParallelForRef pf, const P& policy) {
  kvattn::prefill(cache, layer, q, k, v, out, lse, plan, pf, policy, isa::native{});
}
template <class T, class P>
void mla_decode_kernel(const PagedKvView<T>& kv, const float* q, float* out, float* lse, DecodePlan& plan, ParallelForRef pf,
                       const P& policy) {
  kvattn::mla_decode(kv, q, out, lse, plan, pf, policy, isa::native{});
}

template <class Fn> Table::Entry entry(Fn f) { return reinterpret_cast<Table::Entry>(f); }

// Every (format, policy) pair of one operator into its slots.
template <class T, class... P> void fill_decode(Table& t, type_list<P...>) {
  ((t.decode[DecodeConfigs::slot<T, P>()] = entry(static_cast<DecodeFn<T, P>>(&decode_kernel<T, P>))), ...);
}
template <class T, class... P> void fill_prefill(Table& t, type_list<P...>) {
  ((t.prefill[PrefillConfigs::slot<T, P>()] = entry(static_cast<PrefillFn<T, P>>(&prefill_kernel<T, P>))), ...);
}
template <class T, class... P> void fill_mla_decode(Table& t, type_list<P...>) {
  ((t.mla_decode[MlaDecodeConfigs::slot<T, P>()] = entry(static_cast<MlaDecodeFn<T, P>>(&mla_decode_kernel<T, P>))), ...);
}
template <class... T> void fill_decode(Table& t, type_list<T...>) { (fill_decode<T>(t, decode_policies{}), ...); }
template <class... T> void fill_prefill(Table& t, type_list<T...>) { (fill_prefill<T>(t, prefill_policies{}), ...); }
template <class... T> void fill_mla_decode(Table& t, type_list<T...>) { (fill_mla_decode<T>(t, mla_decode_policies{}), ...); }

Table make_table() {
  Table t{isa::native::name, {}, {}, {}};
  fill_decode(t, decode_formats{});
  fill_prefill(t, prefill_formats{});
  fill_mla_decode(t, mla_decode_formats{});
  return t;
}

}  // namespace
}  // namespace kvattn::kernels::detail

#define KVATTN_KERNELS_CAT2(a, b) a##b
#define KVATTN_KERNELS_CAT(a, b) KVATTN_KERNELS_CAT2(a, b)
extern "C" const kvattn::kernels::detail::Table* KVATTN_KERNELS_CAT(kvattn_kernels_table_, KVATTN_KERNELS_ISA)() {
  static const kvattn::kernels::detail::Table table = kvattn::kernels::detail::make_table();
  return &table;
}
