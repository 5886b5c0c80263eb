// tests/cuda/device.hpp — whether the CUDA tests can run here. Plain C++: the test files that
// include it are compiled by the host compiler; the device code lives in the .cu files.
#pragma once

#include <gtest/gtest.h>

namespace cuda_tests {
/// A CUDA device is usable (false without a GPU or without a driver).
bool device_available();
}  // namespace cuda_tests

/// Skips the current test, saying why, when no CUDA device can be used.
#define KVATTN_REQUIRE_GPU()                                                                        \
  do {                                                                                             \
    if (!cuda_tests::device_available())                                                           \
      GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount failed or found none): kernel not run";  \
  } while (0)
