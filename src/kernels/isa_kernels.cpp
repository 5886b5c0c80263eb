// src/kernels/isa_kernels.cpp — one instruction set's compiled kernels (kvattn/kernels.hpp).
//
// Compiled once per instruction set, with that set's flags and KVATTN_KERNELS_ISA naming it
// (scalar, avx2, avx512, neon); exports one function, kvattn_kernels_table_<isa>, which the
// dispatcher (dispatch.cpp) calls only after checking that the CPU runs the set. The build makes
// every other symbol of the object local (CMakeLists.txt: kvattn_localize_kernels), so no inline
// function compiled here can stand in for another unit's copy.
#include <kvattn/decode.hpp>
#include <kvattn/kernels.hpp>

#if !defined(KVATTN_KERNELS_ISA)
#error "KVATTN_KERNELS_ISA must name the instruction set this unit is compiled for"
#endif
static_assert(std::is_same_v<kvattn::isa::native, kvattn::isa::KVATTN_KERNELS_ISA>,
              "the flags of this unit do not select the instruction set KVATTN_KERNELS_ISA names");

namespace kvattn::kernels::detail {
namespace {

template <class T, class P>
void decode_kernel(const PagedKvView<T>& kv, const float* q, float* out, float* lse, DecodePlan& plan, ParallelForRef pf,
                   const P& policy) {
  kvattn::decode(kv, q, out, lse, plan, pf, policy, isa::native{});
}

template <class T, class... P> void fill_decode(Table& t, type_list<P...>) {
  ((t.decode[decode_slot<T, P>()] = reinterpret_cast<void (*)()>(static_cast<DecodeFn<T, P>>(&decode_kernel<T, P>))), ...);
}
template <class... T> Table make_table(type_list<T...>) {
  Table t{isa::native::name, {}};
  (fill_decode<T>(t, decode_policies{}), ...);
  return t;
}

}  // namespace
}  // namespace kvattn::kernels::detail

#define KVATTN_KERNELS_CAT2(a, b) a##b
#define KVATTN_KERNELS_CAT(a, b) KVATTN_KERNELS_CAT2(a, b)
extern "C" const kvattn::kernels::detail::Table* KVATTN_KERNELS_CAT(kvattn_kernels_table_, KVATTN_KERNELS_ISA)() {
  static const kvattn::kernels::detail::Table table = kvattn::kernels::detail::make_table(kvattn::kernels::decode_formats{});
  return &table;
}
