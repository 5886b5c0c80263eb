// The instruction sets the kernel tests run, as gtest type parameters: the portable scalar path
// and the native one (kvattn::isa::native, the build's best). A build configured with
// KVATTN_TEST_SCALAR_PATH=OFF runs the native one only: the aarch64 preset, whose scalar path is
// the same code the x86-64 builds test, and which is there for the NEON kernels (each kernel a
// test file instantiates costs its compile time again per instruction set).
#pragma once

#include <kvattn/config.hpp>

#include <gtest/gtest.h>

#ifndef KVATTN_TEST_SCALAR_PATH
#define KVATTN_TEST_SCALAR_PATH 1
#endif

namespace isa_tags {

template <class Isa> struct IsaTag {
  using type = Isa;
};
#if KVATTN_TEST_SCALAR_PATH
using Isas = ::testing::Types<IsaTag<kvattn::isa::scalar>, IsaTag<kvattn::isa::native>>;
#else
using Isas = ::testing::Types<IsaTag<kvattn::isa::native>>;
#endif

}  // namespace isa_tags
