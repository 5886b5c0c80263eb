// kvattn/cuda/runtime.hpp — what the CUDA specializations stand on: errors, device memory for the
// paged cache, device buffers, a batch's page table on the device, element conversions.
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
// table are device pointers (DevicePageTable::view).
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

/// A batch's page table (BatchPageTable) on the device, with the host copy the launchers plan from.
/// upload() reuses the device arrays; the host table may change afterwards.
class DevicePageTable {
 public:
  void upload(const BatchPageTable& t, cudaStream_t stream = nullptr) {
    host_ = t;
    indptr_.upload(host_.indptr.data(), host_.indptr.size(), stream);
    indices_.upload(host_.indices.data(), host_.indices.size(), stream);
    last_.upload(host_.last_page_len.data(), host_.last_page_len.size(), stream);
    // The host copies must outlive the asynchronous copies: they are members, kept until the next upload,
    // which first waits for this one.
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize (page table upload)");
  }
  int batch() const noexcept { return host_.batch(); }
  const BatchPageTable& host() const noexcept { return host_; }

  /// One layer of a device cache with this table: every pointer is a device pointer.
  template <class T> PagedKvView<T> view(const PagedKvCache<T, DeviceMemory>& cache, int layer) const {
    PagedKvView<T> v = cache.view(host_, layer);  // checks the layer; host table pointers
    v.indptr = indptr_.data();
    v.indices = indices_.data();
    v.last_page_len = last_.data();
    return v;
  }
  /// The same, over a layer's pool held elsewhere (device memory of `layout`'s pages).
  template <class T> PagedKvView<T> view(const T* layer_pool, const PageLayout& layout) const {
    return PagedKvView<T>{layer_pool, layout, indptr_.data(), indices_.data(), last_.data(), host_.batch()};
  }
  /// The same table with host pointers (the pool pointer is kept as given): what launchers plan from.
  template <class T> PagedKvView<T> host_view(const PagedKvView<T>& device_view) const {
    PagedKvView<T> v = device_view;
    v.indptr = host_.indptr.data();
    v.indices = host_.indices.data();
    v.last_page_len = host_.last_page_len.data();
    v.batch = host_.batch();
    return v;
  }
  /// Whether `v` reads this table's device arrays.
  template <class T> bool describes(const PagedKvView<T>& v) const noexcept {
    return v.indptr == indptr_.data() && v.indices == indices_.data() && v.last_page_len == last_.data() &&
           v.batch == host_.batch();
  }

 private:
  BatchPageTable host_;
  DeviceBuffer<std::int32_t> indptr_, indices_, last_;
};

namespace impl {
/// The device's view of a storage type: fp32 as float, fp16 as __half, bf16 as __nv_bfloat16 (the
/// same 16 bits as kvattn::fp16 and kvattn::bf16).
template <class T> struct device_type { using type = float; };
template <> struct device_type<fp16> { using type = __half; };
template <> struct device_type<bf16> { using type = __nv_bfloat16; };

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <class D> __device__ __forceinline__ D from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

/// Blocks of `threads` covering n.
inline unsigned blocks_for(std::int64_t n, int threads) { return static_cast<unsigned>((n + threads - 1) / threads); }
}  // namespace impl

}  // namespace kvattn::cuda
