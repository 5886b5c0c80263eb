# Cross-compiles for 64-bit Arm Linux with Debian's cross toolchain (g++-aarch64-linux-gnu) and
# runs the results under qemu-user (qemu-aarch64), so that the NEON code paths build and pass the
# tests on an x86-64 machine: `cmake --preset aarch64` (cmake/setup-debian.sh --cross installs both).
#
# Eigen is found on the host: it is headers only and the same for every architecture. GoogleTest
# is compiled for the target from its source (tests/CMakeLists.txt), never the host's libraries.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)

# Test programs (and gtest_discover_tests, which lists their tests) run through qemu-user; -L is
# where the target's dynamic loader and C++ runtime live.
set(CMAKE_CROSSCOMPILING_EMULATOR "qemu-aarch64;-L;/usr/aarch64-linux-gnu")

# Libraries and headers of the target only from the cross toolchain's tree; programs (and
# CMake package files such as Eigen's) from the host.
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)
