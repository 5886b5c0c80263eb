// tests/cuda/device.cu — the device check of device.hpp.
#include <kvattn/cuda/runtime.hpp>

#include "device.hpp"

namespace cuda_tests {
bool device_available() { return kvattn::cuda::device_available(); }
}  // namespace cuda_tests
