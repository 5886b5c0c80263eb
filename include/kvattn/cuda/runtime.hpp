// kvattn/cuda/runtime.hpp — what the CUDA specializations stand on: errors, device memory for the
// paged cache, device buffers, pinned staging and events for uploads that never wait, element
// conversions.
//
// The headers under kvattn/cuda/ are for translation units compiled by nvcc with
// KVATTN_ENABLE_CUDA=1 (the kvattn::cuda CMake target defines it and adds CUDA::cudart); an engine
// that never compiles CUDA never sees them. Every function that launches work takes a stream and
// returns without waiting for it; the host-side bookkeeping (PagedKvCache's page tables, reference
// counts, free list) is the same as on the CPU.
//
// Device storage: PagedKvCache<T, cuda::DeviceMemory> keeps its pool in cudaMalloc memory (no
// managed memory) and its bookkeeping on the host. Host reads and writes (write, read, ...) do not
// compile for it; tokens are written with cuda::write_kv / cuda::write_latent (append.hpp) after
// PagedKvCache::make_writable, and read by the kernels through a PagedKvView whose pool and page
// table are device pointers (cuda::DecodePlan::view, plan.hpp).
#pragma once

#if !defined(__CUDACC__)
#error "kvattn/cuda/*.hpp are CUDA headers: include them from a .cu file compiled by nvcc"
#endif
#if !defined(KVATTN_ENABLE_CUDA) || !KVATTN_ENABLE_CUDA
#error "kvattn/cuda/*.hpp need KVATTN_ENABLE_CUDA=1 (link the kvattn::cuda CMake target)"
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../error.hpp"
#include "../paged_cache.hpp"
#include "../storage.hpp"

namespace kvattn::cuda {

/// A CUDA runtime call failed; what() names the call and the runtime's message.
class cuda_error : public std::runtime_error {
 public:
  cuda_error(const std::string& what, cudaError_t code) : std::runtime_error(what), code_(code) {}
  cudaError_t code() const noexcept { return code_; }

 private:
  cudaError_t code_;
};

/// Throws cuda_error for anything but cudaSuccess.
inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw cuda_error(kvattn::detail::concat("kvattn::cuda: ", what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"), e);
}

/// Devices this process can use; 0 when there is none or no driver at all (any error counts as
/// none: without a driver cudaGetDeviceCount fails rather than reporting 0).
inline int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the error so later calls do not see it
    return 0;
  }
  return n;
}
inline bool device_available() noexcept { return device_count() > 0; }

/// Streaming multiprocessors of the current device (for choosing how finely to split work).
inline int multiprocessors() {
  int device = 0, sms = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  return sms;
}

/// The memory space of a device cache (memory.hpp): plain cudaMalloc memory, zero-filled.
struct DeviceMemory {
  static constexpr bool host_accessible = false;

  static void* allocate(std::size_t bytes) {
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    if (cudaMalloc(&p, bytes) != cudaSuccess) {
      (void)cudaGetLastError();
      throw std::bad_alloc();
    }
    // Zeroed before it is returned: cudaMemset runs on the legacy default stream, which a
    // non-blocking stream of the caller would not wait for.
    cudaError_t e = cudaMemset(p, 0, bytes);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
      cudaFree(p);
      check(e, "zeroing new device memory");
    }
    return p;
  }
  static void deallocate(void* p, std::size_t /*bytes*/) noexcept {
    if (p != nullptr) (void)cudaFree(p);
  }
  /// The copy-on-write of a page. Copies are rare (the first write into a shared page), so each
  /// is ordered against every stream: the writer's may be non-blocking, and its earlier kernels
  /// must finish writing the old page before the copy, the copy before its next kernel. It cannot
  /// fail on a working device; if the device itself has failed the cache can no longer be kept
  /// consistent, and the program stops with the reason.
  static void copy(void* dst, const void* src, std::size_t bytes) noexcept {
    cudaError_t e = cudaDeviceSynchronize();
    if (e == cudaSuccess) e = cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
      std::fprintf(stderr, "kvattn::cuda::DeviceMemory::copy: %s (%s)\n", cudaGetErrorName(e), cudaGetErrorString(e));
      std::abort();
    }
  }
};

/// An owned device array of T that only grows (reserve); contents are not kept across growth.
template <class T> class DeviceBuffer {
  static_assert(std::is_trivially_copyable_v<T>, "DeviceBuffer holds plain data");

 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t n) { reserve(n); }
  ~DeviceBuffer() { DeviceMemory::deallocate(data_, capacity_ * sizeof(T)); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : data_(o.data_), capacity_(o.capacity_) {
    o.data_ = nullptr;
    o.capacity_ = 0;
  }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(capacity_, o.capacity_);
    return *this;
  }

  /// Room for n elements (a larger allocation when needed; old contents are dropped).
  T* reserve(std::size_t n) {
    if (n > capacity_) {
      T* p = static_cast<T*>(DeviceMemory::allocate(n * sizeof(T)));
      DeviceMemory::deallocate(data_, capacity_ * sizeof(T));
      data_ = p;
      capacity_ = n;
    }
    return data_;
  }
  /// Copies host[0, n) to the device (growing as needed), ordered on `stream`.
  T* upload(const T* host, std::size_t n, cudaStream_t stream) {
    reserve(n);
    if (n > 0) check(cudaMemcpyAsync(data_, host, n * sizeof(T), cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync (upload)");
    return data_;
  }
  T* data() noexcept { return data_; }
  const T* data() const noexcept { return data_; }
  std::size_t capacity() const noexcept { return capacity_; }

 private:
  T* data_ = nullptr;
  std::size_t capacity_ = 0;
};

/// Page-locked host memory (cudaHostAlloc) that only grows: the staging of asynchronous uploads,
/// which the copy engine reads while the host goes on. Contents are not kept across growth.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer() {
    if (data_ != nullptr) (void)cudaFreeHost(data_);
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  PinnedBuffer(PinnedBuffer&& o) noexcept : data_(std::exchange(o.data_, nullptr)), capacity_(std::exchange(o.capacity_, 0)) {}
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(capacity_, o.capacity_);
    return *this;
  }

  /// Room for `bytes` bytes (a larger allocation when needed; old contents are dropped). The
  /// caller has made sure no copy still reads the old memory.
  unsigned char* reserve(std::size_t bytes) {
    if (bytes > capacity_) {
      void* p = nullptr;
      check(cudaHostAlloc(&p, bytes, cudaHostAllocDefault), "cudaHostAlloc (staging)");
      if (data_ != nullptr) (void)cudaFreeHost(data_);
      data_ = static_cast<unsigned char*>(p);
      capacity_ = bytes;
    }
    return data_;
  }
  unsigned char* data() noexcept { return data_; }
  const unsigned char* data() const noexcept { return data_; }
  std::size_t capacity() const noexcept { return capacity_; }

 private:
  unsigned char* data_ = nullptr;
  std::size_t capacity_ = 0;
};

/// A CUDA event, created on first use (constructing one touches no device).
class Event {
 public:
  Event() = default;
  ~Event() {
    if (e_ != nullptr) (void)cudaEventDestroy(e_);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  Event(Event&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
  Event& operator=(Event&& o) noexcept {
    std::swap(e_, o.e_);
    return *this;
  }
  /// Marks the work queued on `stream` so far.
  void record(cudaStream_t stream) {
    if (e_ == nullptr) check(cudaEventCreateWithFlags(&e_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    check(cudaEventRecord(e_, stream), "cudaEventRecord");
  }
  /// Waits for the work marked last (nothing if none was).
  void wait() const {
    if (e_ != nullptr) check(cudaEventSynchronize(e_), "cudaEventSynchronize");
  }
  /// wait() for destructors: errors are dropped (a failed device reports them at its next call).
  void wait_quietly() const noexcept {
    if (e_ != nullptr) (void)cudaEventSynchronize(e_);
  }

 private:
  cudaEvent_t e_ = nullptr;
};

/// Host data sent to the device without waiting for it: packed into pinned staging (stage), then
/// one asynchronous copy on the caller's stream (send) into a device allocation that only grows.
/// The copy is marked with an event, and the next stage() waits for it before the staging is
/// written again, so the host never overwrites what a copy still reads and never waits for
/// anything else. Growing the device allocation frees the old one (cudaFree waits for the device).
class StagedUpload {
 public:
  StagedUpload() = default;
  ~StagedUpload() { sent_.wait_quietly(); }  // the last copy may still read the staging
  StagedUpload(const StagedUpload&) = delete;
  StagedUpload& operator=(const StagedUpload&) = delete;

  /// Room for `bytes` bytes of staging, once the last copy from it is done.
  unsigned char* stage(std::size_t bytes) {
    sent_.wait();
    return staging_.reserve(bytes);
  }
  /// Copies the first `bytes` bytes of the staging to the device on `stream` and returns where
  /// they will be (null for 0 bytes).
  unsigned char* send(std::size_t bytes, cudaStream_t stream) {
    if (bytes == 0) return nullptr;
    unsigned char* device = device_.reserve(bytes);
    check(cudaMemcpyAsync(device, staging_.data(), bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync (upload)");
    sent_.record(stream);
    return device;
  }
  const unsigned char* staging() const noexcept { return staging_.data(); }
  std::size_t device_bytes() const noexcept { return device_.capacity(); }
  std::size_t host_bytes() const noexcept { return staging_.capacity(); }

 private:
  PinnedBuffer staging_;
  DeviceBuffer<unsigned char> device_;
  Event sent_;
};

namespace impl {
/// An 8-bit format's code as the kernels read it (one byte of the page): an int8 code, whose
/// value is q, and an fp8 e4m3 code, whose value is q · 2^-8 as on the host (format.hpp: the
/// byte's exponent and mantissa placed in an fp16's, one conversion), so that the page's scales
/// apply as they are.
struct Int8Code {
  std::int8_t q;
};
struct E4m3Code {
  std::uint8_t bits;
};

/// The device's view of a format's unit: fp32 as float, fp16 as __half, bf16 as __nv_bfloat16 (the
/// same 16 bits as kvattn::fp16 and kvattn::bf16), the 8-bit formats' bytes as Int8Code and
/// E4m3Code (their scales are read beside them: format_traits<T>).
template <class T> struct device_type {
  static_assert(std::is_same_v<T, fp32>,
                "kvattn::cuda: the CUDA kernels read fp32, fp16, bf16, int8_row, fp8_e4m3_row, fp8_e4m3_layer, fp8_e4m3_latent and "
                "int8_latent caches (the 4-bit and the rotated formats are CPU formats)");
  using type = float;
};
template <> struct device_type<fp16> { using type = __half; };
template <> struct device_type<bf16> { using type = __nv_bfloat16; };
template <> struct device_type<int8_row> { using type = Int8Code; };
template <> struct device_type<int8_latent> { using type = Int8Code; };
template <> struct device_type<fp8_e4m3_row> { using type = E4m3Code; };
template <> struct device_type<fp8_e4m3_layer> { using type = E4m3Code; };
template <> struct device_type<fp8_e4m3_latent> { using type = E4m3Code; };

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(Int8Code x) { return static_cast<float>(x.q); }
__device__ __forceinline__ float to_float(E4m3Code x) {
  const unsigned b = x.bits;
  return __half2float(__ushort_as_half(static_cast<unsigned short>(((b & 0x80u) << 8) | ((b & 0x7Fu) << 7))));
}
template <class E> __device__ __forceinline__ E from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

/// Blocks of `threads` covering n.
inline unsigned blocks_for(std::int64_t n, int threads) { return static_cast<unsigned>((n + threads - 1) / threads); }
}  // namespace impl

}  // namespace kvattn::cuda
