// src/kernels/dispatch.cpp — the choice of the compiled kernels' instruction set
// (kvattn/kernels.hpp). Compiled for the architecture's baseline: it runs before anything is
// known of the CPU, and calls an instruction set's code only after checking that the CPU runs it.
//
// The build defines KVATTN_KERNELS_HAVE_<ISA> (1 or 0) for each instruction set whose unit it
// compiled (isa_kernels.cpp).
#include <kvattn/error.hpp>
#include <kvattn/kernels.hpp>

#include <atomic>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include <cstdlib>
#include <string>

namespace {
using kvattn::kernels::detail::Table;
}

extern "C" {
#if KVATTN_KERNELS_HAVE_AVX512
const Table* kvattn_kernels_table_avx512();
#endif
#if KVATTN_KERNELS_HAVE_AVX2
const Table* kvattn_kernels_table_avx2();
#endif
#if KVATTN_KERNELS_HAVE_NEON
const Table* kvattn_kernels_table_neon();
#endif
const Table* kvattn_kernels_table_scalar();
}

namespace kvattn::kernels {
namespace {

struct Candidate {
  std::string_view name;
  bool (*runs)();                 // whether this CPU runs it (and its operating system keeps its registers)
  const Table* (*table)();
};

#if KVATTN_KERNELS_HAVE_AVX2 || KVATTN_KERNELS_HAVE_AVX512
// What config.hpp requires of each set (KVATTN_TARGET_HAS_AVX2 / _AVX512), which the units' flags
// enable; __builtin_cpu_supports also checks that the operating system saves the registers.
bool runs_avx2() {
  __builtin_cpu_init();
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;  // F16C: CPUID leaf 1, ECX (not every compiler's builtin names it)
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
  return f16c && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#endif
#if KVATTN_KERNELS_HAVE_AVX512
bool runs_avx512() {
  return runs_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}
#endif
bool runs_always() { return true; }

// Best first.
const Candidate kCandidates[] = {
#if KVATTN_KERNELS_HAVE_AVX512
    {"avx512", runs_avx512, kvattn_kernels_table_avx512},
#endif
#if KVATTN_KERNELS_HAVE_AVX2
    {"avx2", runs_avx2, kvattn_kernels_table_avx2},
#endif
#if KVATTN_KERNELS_HAVE_NEON
    {"neon", runs_always, kvattn_kernels_table_neon},  // every aarch64 CPU has it
#endif
    {"scalar", runs_always, kvattn_kernels_table_scalar},
};

std::string names(const std::vector<std::string_view>& list) {
  std::string s;
  for (std::string_view n : list) s.append(s.empty() ? "" : ", ").append(n);
  return s;
}

// The table `name` names ("best": the first that runs); nullptr if none does.
const Table* find(std::string_view name) {
  for (const Candidate& c : kCandidates)
    if ((name == "best" || name == c.name) && c.runs()) return c.table();
  return nullptr;
}

const Table* find_or_raise(std::string_view name, const char* what) {
  const Table* t = find(name);
  if (t == nullptr)
    raise<invalid_argument>(kvattn::detail::concat(what, "\"", std::string(name), "\": not an instruction set of this CPU's "
                                                    "compiled kernels (", names(isas()), ", or best)"));
  return t;
}

std::atomic<const Table*> g_chosen{nullptr};

const Table* first_choice() {
  const char* env = std::getenv("KVATTN_ISA");
  return env != nullptr && *env != '\0' ? find_or_raise(env, "kvattn::kernels: KVATTN_ISA=") : find("best");
}

}  // namespace

namespace detail {
const Table& table() {
  const Table* t = g_chosen.load(std::memory_order_acquire);
  if (t == nullptr) {
    static const Table* const first = first_choice();  // KVATTN_ISA read once, thread-safe
    const Table* expected = nullptr;
    g_chosen.compare_exchange_strong(expected, first, std::memory_order_acq_rel);
    t = g_chosen.load(std::memory_order_acquire);
  }
  return *t;
}
}  // namespace detail

std::string_view isa() { return detail::table().isa; }

std::vector<std::string_view> isas() {
  std::vector<std::string_view> list;
  for (const Candidate& c : kCandidates)
    if (c.runs()) list.push_back(c.name);
  return list;
}

void set_isa(std::string_view name) {
  g_chosen.store(find_or_raise(name, "kvattn::kernels::set_isa: name="), std::memory_order_release);
}

}  // namespace kvattn::kernels
