// The instruction sets the kernel tests run, as gtest type parameters: the native one
// (kvattn::isa::native, the build's best) and, in a build configured with
// KVATTN_TEST_SCALAR_PATH=ON, the portable scalar path beside it. Each kernel a test file
// instantiates costs its compile time again per instruction set, so the presets leave the scalar
// path to the scalar preset (KVATTN_FORCE_SCALAR), whose native path it is.
#pragma once

#include <kvattn/config.hpp>

#include <gtest/gtest.h>

#ifndef KVATTN_TEST_SCALAR_PATH
#define KVATTN_TEST_SCALAR_PATH 0
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
