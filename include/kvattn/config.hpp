// kvattn/config.hpp — version, instruction-set selection and the per-target namespace.
//
// Every kernel in kvattn takes an instruction-set tag (kvattn::isa::scalar, avx2, avx512,
// neon) as its first parameter. Tags inherit from the set they extend (avx512 : avx2 : scalar,
// neon : scalar), so a call with a tag that a kernel has no overload for falls back to the
// nearest base. isa::native is the best set the compiler targets in this translation unit;
// KVATTN_FORCE_SCALAR (defined to 1, or the CMake option of that name) makes it isa::scalar.
//
// Kernels also live in an inline namespace named after the compiler's target
// (kvattn::target_avx2, kvattn::target_avx512, ...), so two translation units built with
// different -m flags can include the same header and link into one program without their
// inline functions colliding (the one-definition rule would otherwise let the linker keep
// either copy). Types (shapes, containers) stay in namespace kvattn and are shared.
#pragma once

#include <string_view>

#define KVATTN_VERSION_MAJOR 0
#define KVATTN_VERSION_MINOR 1
#define KVATTN_VERSION_PATCH 0
#define KVATTN_VERSION_STRING "0.1.0"

#if !defined(KVATTN_FORCE_SCALAR)
#define KVATTN_FORCE_SCALAR 0
#endif

// What the compiler targets in this translation unit (independent of KVATTN_FORCE_SCALAR).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && \
    defined(__FMA__) && defined(__F16C__)
#define KVATTN_TARGET_HAS_AVX512 1
#else
#define KVATTN_TARGET_HAS_AVX512 0
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVATTN_TARGET_HAS_AVX2 1
#else
#define KVATTN_TARGET_HAS_AVX2 0
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#define KVATTN_TARGET_HAS_NEON 1
#else
#define KVATTN_TARGET_HAS_NEON 0
#endif

// Which SIMD code paths this translation unit compiles (all 0 when forced scalar).
#if KVATTN_FORCE_SCALAR
#define KVATTN_HAS_AVX512 0
#define KVATTN_HAS_AVX2 0
#define KVATTN_HAS_NEON 0
#else
#define KVATTN_HAS_AVX512 KVATTN_TARGET_HAS_AVX512
#define KVATTN_HAS_AVX2 KVATTN_TARGET_HAS_AVX2
#define KVATTN_HAS_NEON KVATTN_TARGET_HAS_NEON
#endif

// The inline namespace of this translation unit's target. The name follows the compiler's
// flags, not only the code path kvattn selects, because scalar code compiled with -mavx2 is
// still AVX2 machine code.
#if defined(__AVX512F__)
#define KVATTN_DETAIL_TARGET avx512
#elif defined(__AVX2__)
#define KVATTN_DETAIL_TARGET avx2
#elif defined(__AVX__)
#define KVATTN_DETAIL_TARGET avx
#elif defined(__aarch64__)
#define KVATTN_DETAIL_TARGET aarch64
#elif defined(__x86_64__) || defined(__i386__)
#define KVATTN_DETAIL_TARGET x86
#else
#define KVATTN_DETAIL_TARGET generic
#endif
#define KVATTN_DETAIL_CAT2(a, b) a##b
#define KVATTN_DETAIL_CAT(a, b) KVATTN_DETAIL_CAT2(a, b)
#if KVATTN_FORCE_SCALAR
#define KVATTN_TARGET_NAMESPACE KVATTN_DETAIL_CAT(KVATTN_DETAIL_CAT(target_, KVATTN_DETAIL_TARGET), _scalar)
#else
#define KVATTN_TARGET_NAMESPACE KVATTN_DETAIL_CAT(target_, KVATTN_DETAIL_TARGET)
#endif
/// Opens the per-target inline namespace; use inside namespace kvattn.
#define KVATTN_BEGIN_TARGET_NAMESPACE inline namespace KVATTN_TARGET_NAMESPACE {
#define KVATTN_END_TARGET_NAMESPACE }

#if defined(__GNUC__) || defined(__clang__)
/// A hint to bring the cache line at p into every cache level for reading; never faults.
#define KVATTN_PREFETCH(p) __builtin_prefetch((p), 0, 3)
/// A hint to bring the cache line at p into the second-level cache (not the first) for reading:
/// for streams read once, far enough ahead that the first level could not hold what is in flight.
#define KVATTN_PREFETCH_L2(p) __builtin_prefetch((p), 0, 1)
#else
#define KVATTN_PREFETCH(p) ((void)(p))
#define KVATTN_PREFETCH_L2(p) ((void)(p))
#endif
/// Unrolls the loop that follows completely (a loop over a compile-time count of vector
/// registers must be unrolled for them to stay registers, at -O2 too). Only for loops whose
/// count is a compile-time constant: clang demands the complete unroll and warns
/// (-Wpass-failed, an error under -Werror) where it cannot honour it.
#if defined(__CUDA_ARCH__)  // nvcc, device pass
#define KVATTN_UNROLL _Pragma("unroll")
#elif defined(__CUDACC__)  // nvcc, host pass: its front end rejects "GCC unroll", g++ rejects "unroll"
#define KVATTN_UNROLL
#elif defined(__clang__)
#define KVATTN_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define KVATTN_UNROLL _Pragma("GCC unroll 16")
#else
#define KVATTN_UNROLL
#endif
/// Functions the CUDA kernels call too (the softmax state, the score policies): host and device
/// functions under nvcc, plain functions everywhere else.
#if defined(__CUDACC__)
#define KVATTN_HOST_DEVICE __host__ __device__
#else
#define KVATTN_HOST_DEVICE
#endif
/// KVATTN_NOINLINE keeps a register-blocked inner kernel a function of its own, so that its
/// accumulators get the vector registers rather than whatever its caller keeps live.
#if defined(__GNUC__) || defined(__clang__)
#define KVATTN_ALWAYS_INLINE inline __attribute__((always_inline))
#define KVATTN_NOINLINE __attribute__((noinline))
#define KVATTN_RESTRICT __restrict__
#else
#define KVATTN_ALWAYS_INLINE inline
#define KVATTN_NOINLINE
#define KVATTN_RESTRICT
#endif

namespace kvattn {

/// Instruction-set tags. A kernel for a tag exists only where the translation unit is compiled
/// for that set; calling with a richer tag runs the nearest base's (compiled_isa_t, below).
/// Each names its set, its fp32 lanes per vector, and the vector registers the kernels plan
/// their register blocks around (rows and accumulators held at once): a new set states its own.
namespace isa {
struct scalar {
  static constexpr std::string_view name = "scalar";
  static constexpr int f32_lanes = 1;
  static constexpr int vector_registers = 16;  // x86-64's SSE registers, the fewest of the targets
};
struct avx2 : scalar {
  static constexpr std::string_view name = "avx2";
  static constexpr int f32_lanes = 8;
  static constexpr int vector_registers = 16;
};
struct avx512 : avx2 {
  static constexpr std::string_view name = "avx512";
  static constexpr int f32_lanes = 16;
  static constexpr int vector_registers = 32;
};
struct neon : scalar {
  static constexpr std::string_view name = "neon";
  static constexpr int f32_lanes = 4;
  static constexpr int vector_registers = 32;
};

#if KVATTN_HAS_AVX512
using native = avx512;
#elif KVATTN_HAS_AVX2
using native = avx2;
#elif KVATTN_HAS_NEON
using native = neon;
#else
using native = scalar;
#endif
}  // namespace isa

KVATTN_BEGIN_TARGET_NAMESPACE
/// The instruction set whose code a call tagged `Isa` runs in this translation unit: `Isa` where
/// the unit is compiled for it, else its nearest base that the unit is compiled for (avx512, then
/// avx2, then scalar; neon, then scalar). Every operator maps its tag through it, so that a tag
/// richer than the unit's target (isa::avx512 in an AVX2 build) runs the target's own kernels.
template <class Isa> struct compiled_isa {
  using type = Isa;
};
#if !KVATTN_HAS_AVX2
template <> struct compiled_isa<isa::avx2> {
  using type = isa::scalar;
};
#endif
#if !KVATTN_HAS_AVX512
template <> struct compiled_isa<isa::avx512> {
  using type = compiled_isa<isa::avx2>::type;
};
#endif
#if !KVATTN_HAS_NEON
template <> struct compiled_isa<isa::neon> {
  using type = isa::scalar;
};
#endif
template <class Isa> using compiled_isa_t = typename compiled_isa<Isa>::type;

/// A type of this translation unit's own target. Member function templates of shared classes
/// (PagedKvCache, say) that run SIMD code take it as a defaulted template argument, so that
/// their symbols, too, differ between translation units built for different targets.
struct this_target {
  using isa = kvattn::isa::native;
};
KVATTN_END_TARGET_NAMESPACE

}  // namespace kvattn
