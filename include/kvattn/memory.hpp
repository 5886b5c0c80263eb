// kvattn/memory.hpp — where a container's storage lives.
//
// A memory space is a type with static functions; containers take it as a template parameter so
// that the same bookkeeping serves host memory now and device memory later:
//   allocate(bytes)        -> pointer aligned to kAlignment, zero-filled; throws std::bad_alloc
//   deallocate(p, bytes)   -> frees what allocate returned
//   copy(dst, src, bytes)  -> copies within the space (the copy-on-write of a page)
//   host_accessible        -> whether the host may read and write the storage directly
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace kvattn {

/// Cache-line alignment of every allocation and of every page (bytes).
inline constexpr std::size_t kAlignment = 64;
/// Alignment of large host allocations (a transparent huge page on x86-64 and most aarch64).
inline constexpr std::size_t kHugePage = std::size_t{2} << 20;

namespace detail {
/// The first element of `p`'s array that starts on a cache line (kAlignment): at most
/// kAlignment / sizeof(T) - 1 elements in, for a buffer (std::vector's, say) that may not.
template <class T> T* align_to_line(T* p) noexcept {
  static_assert(kAlignment % sizeof(T) == 0);
  const std::size_t past = reinterpret_cast<std::uintptr_t>(p) % kAlignment / sizeof(T);
  return p + (past == 0 ? 0 : kAlignment / sizeof(T) - past);
}
/// Floats in a cache line, and a count of floats rounded up to whole lines: kernels lay their
/// scratch rows out so that every row starts on a line (a vector load that straddles two lines
/// costs two).
inline constexpr int kLineFloats = static_cast<int>(kAlignment / sizeof(float));
constexpr std::int64_t whole_lines(std::int64_t floats) noexcept { return (floats + kLineFloats - 1) / kLineFloats * kLineFloats; }
}  // namespace detail

/// Aligned host memory, zero-filled.
struct HostMemory {
  static constexpr bool host_accessible = true;

  static void* allocate(std::size_t bytes) {
    if (bytes == 0) return nullptr;
    // Large pools start on a 2 MiB boundary and ask for transparent huge pages: fewer TLB
    // misses when a kernel streams pages, and a faster first touch.
    const std::size_t align = bytes >= kHugePage ? kHugePage : kAlignment;
    const std::size_t rounded = (bytes + align - 1) / align * align;
    void* p = std::aligned_alloc(align, rounded);
    if (p == nullptr) {
#if defined(__cpp_exceptions) || defined(__EXCEPTIONS) || defined(_CPPUNWIND)
      throw std::bad_alloc();
#else
      std::abort();
#endif
    }
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (align == kHugePage) ::madvise(p, rounded, MADV_HUGEPAGE);  // advice only: failure is harmless
#endif
    std::memset(p, 0, rounded);
    return p;
  }
  static void deallocate(void* p, std::size_t /*bytes*/) noexcept { std::free(p); }
  static void copy(void* dst, const void* src, std::size_t bytes) noexcept { std::memcpy(dst, src, bytes); }
};

}  // namespace kvattn
