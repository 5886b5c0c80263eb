#!/usr/bin/env bash
# Installs what building and testing kvattn needs on Debian (12 or newer), and nothing that is
# already there: a compiler, CMake, Ninja, Eigen 3.4, GoogleTest and Google Benchmark.
# Runs as root, or through sudo when it is not root. Safe to run again.
#
#   bash cmake/setup-debian.sh            # the packages above
#   bash cmake/setup-debian.sh --cross    # also the aarch64 cross compiler, qemu-user and
#                                         # GoogleTest's source (the aarch64 preset builds it)
#   bash cmake/setup-debian.sh --clang    # also clang++ (the clang preset)
set -euo pipefail

packages=(g++ cmake ninja-build libeigen3-dev libgtest-dev libgmock-dev libbenchmark-dev)
for arg in "$@"; do
  case "$arg" in
    --cross) packages+=(g++-aarch64-linux-gnu qemu-user googletest) ;;
    --clang) packages+=(clang) ;;
    *) echo "setup-debian.sh: unknown argument '$arg' (expected --cross or --clang)" >&2; exit 2 ;;
  esac
done

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$'; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup-debian.sh: all build dependencies are installed"
  exit 0
fi

as_root=()
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null 2>&1; then
    echo "setup-debian.sh: missing packages (${missing[*]}) and not root; run as root or install sudo" >&2
    exit 1
  fi
  as_root=(sudo)
fi
echo "setup-debian.sh: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -qq
"${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
