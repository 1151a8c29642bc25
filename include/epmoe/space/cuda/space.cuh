// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// space::cuda<T>: the layer's primitives on one GPU. Memory is device memory (cudaMalloc) with
// pinned host mirrors; loops are grid-stride kernels over the host's EPMOE_HD functors; the
// plan's count, scan and stable sort are a histogram kernel and CUB; GEMMs are cuBLAS (the
// experts' as one grouped call); the stage clock is CUDA events. Everything runs on the
// space's work stream, ordered after the caller's stream when a pass begins and before it
// when the pass ends (enter/leave), so the caller's stream (PyTorch's current stream) never
// races with the layer. Copies of a space share its streams, cuBLAS handle and events.
#include <algorithm>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>
#include <memory>
#include <type_traits>
#include <vector>

#include "epmoe/core/view.hpp"
#include "epmoe/space/cuda/grouped_gemm.cuh"
#include "epmoe/space/cuda/kernels.cuh"
#include "epmoe/space/cuda/runtime.cuh"

namespace epmoe::space {

/// A device array with a pinned host copy: the space's stages use device(), host code
/// host(); to_host / to_device copy a range on the work stream.
template <class T>
class cuda_mirror {
 public:
  cuda_mirror() = default;
  explicit cuda_mirror(index_t n) : dev_(n), host_(n) {}
  T* device() const { return dev_.data(); }
  T* host() const { return host_.data(); }
  index_t size() const { return dev_.size(); }

 private:
  device_buffer<T> dev_;
  pinned_buffer<T> host_;
};

template <class T = float>
class cuda : public allocates<cuda<T>> {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, __nv_bfloat16> ||
                    std::is_same_v<T, __half>,
                "epmoe: space::cuda<T> takes float, __nv_bfloat16 or __half");

 public:
  using value_type = T;
  static constexpr bool device = true;
  template <class U>
  using buffer = device_buffer<U>;
  template <class U>
  using mirror = cuda_mirror<U>;

  /// The caller's stream (0: the legacy default stream): each pass waits for the work on it
  /// so far, and work queued on it later waits for the pass. The layer works on its own
  /// streams; pass the caller's current stream (PyTorch's) to order the two.
  cuda() : cuda(nullptr) {}
  explicit cuda(cudaStream_t caller) : ctx_(std::make_shared<context>(caller)) {}

  /// The stream the layer's work runs on, and the one its non-blocking exchanges use.
  cudaStream_t stream() const { return ctx_->work; }
  cudaStream_t comm_stream() const { return ctx_->comm; }
  cudaStream_t caller() const { return ctx_->caller; }
  cublasHandle_t blas() const { return ctx_->blas; }

  template <class U>
  void to_host(const mirror<U>& m, index_t first, index_t n) const {
    if (n > 0)
      EPMOE_CUDA_CHECK(cudaMemcpyAsync(m.host() + first, m.device() + first, sizeof(U) * n,
                                       cudaMemcpyDeviceToHost, ctx_->work));
  }
  template <class U>
  void to_device(const mirror<U>& m, index_t first, index_t n) const {
    if (n > 0)
      EPMOE_CUDA_CHECK(cudaMemcpyAsync(m.device() + first, m.host() + first, sizeof(U) * n,
                                       cudaMemcpyHostToDevice, ctx_->work));
  }

  template <class F>
  void for_each(index_t n, const F& f) const {
    if (n <= 0) return;
    cuda_kernels::
        for_each<<<cuda_kernels::grid_for(n), cuda_kernels::block_threads, 0, ctx_->work>>>(n, f);
    EPMOE_CUDA_CHECK(cudaGetLastError());
  }
  /// Row functors get pieces of `piece` columns, one per thread.
  template <class F>
  void for_each_row(index_t n, index_t width, const F& f) const {
    launch_rows(n, nullptr, width, f);
  }
  template <class F>
  void for_each_row_n(const index_t* n, index_t max_n, index_t width, const F& f) const {
    launch_rows(max_n, n, width, f);
  }

  template <class U>
  void fill(U* p, index_t n, U v) const {
    if (n <= 0) return;
    cuda_kernels::fill<<<cuda_kernels::grid_for(n), cuda_kernels::block_threads, 0, ctx_->work>>>(
        p, n, v);
    EPMOE_CUDA_CHECK(cudaGetLastError());
  }

  void copy_blocks(matrix_view<const T> src, matrix_view<T> dst, index_t n,
                   const index_t* src_offset, const index_t* dst_offset,
                   const index_t* count) const {
    if (n <= 0) return;
    const dim3 grid(64, static_cast<unsigned>(std::min<index_t>(n, 65535)));
    cuda_kernels::copy_blocks<<<grid, cuda_kernels::block_threads, 0, ctx_->work>>>(
        src, dst, n, src_offset, dst_offset, count);
    EPMOE_CUDA_CHECK(cudaGetLastError());
  }

  // --- the plan's primitives ------------------------------------------------------------

  /// CUB's radix sort storage and the iota values it carries, for n keys.
  static index_t sort_scratch_bytes(index_t n, index_t bins) {
    std::size_t sort = 0, scan = 0;
    EPMOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
        nullptr, sort, static_cast<const int*>(nullptr), static_cast<int*>(nullptr),
        static_cast<const int*>(nullptr), static_cast<int*>(nullptr), static_cast<int>(n)));
    EPMOE_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, scan, static_cast<index_t*>(nullptr),
                                                   static_cast<index_t*>(nullptr),
                                                   static_cast<int>(std::max(n, bins))));
    return static_cast<index_t>(std::max(sort, scan) + 256 + sizeof(std::int32_t) * n);
  }
  void count(const std::int32_t* keys, index_t n, index_t bins, index_t* out) const {
    static_assert(sizeof(index_t) == sizeof(unsigned long long));
    EPMOE_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(index_t) * bins, ctx_->work));
    if (n <= 0) return;
    cuda_kernels::
        histogram<<<cuda_kernels::grid_for(n), cuda_kernels::block_threads, 0, ctx_->work>>>(
            keys, n, bins, reinterpret_cast<unsigned long long*>(out));
    EPMOE_CUDA_CHECK(cudaGetLastError());
  }
  void exclusive_scan(const index_t* in, index_t* out, index_t n) const {
    if (n > 0) {
      std::size_t bytes = static_cast<std::size_t>(ctx_->scan_bytes);
      EPMOE_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(ctx_->scan_temp(), bytes, in, out,
                                                     static_cast<int>(n), ctx_->work));
    }
    cuda_kernels::scan_total<<<1, 1, 0, ctx_->work>>>(in, out, n);
    EPMOE_CUDA_CHECK(cudaGetLastError());
  }
  void sort_by_key(const std::int32_t* keys, index_t n, index_t bins, std::int32_t* sorted_keys,
                   std::int32_t* order, void* scratch) const {
    if (n <= 0) return;
    auto* values = static_cast<std::int32_t*>(scratch);
    void* temp = values + n;
    cuda_kernels::iota<<<cuda_kernels::grid_for(n), cuda_kernels::block_threads, 0, ctx_->work>>>(
        values, n);
    int end_bit = 1;
    while ((index_t{1} << end_bit) <= bins) ++end_bit;  // keys are in [0, bins]
    std::size_t bytes = 0;
    EPMOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, bytes, keys, sorted_keys, values,
                                                     order, static_cast<int>(n), 0, end_bit,
                                                     ctx_->work));
    EPMOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, bytes, keys, sorted_keys, values, order,
                                                     static_cast<int>(n), 0, end_bit, ctx_->work));
  }

  // --- GEMMs ----------------------------------------------------------------------------

  /// c [M, N] = a [M, K] x b [N, K]^T, fp32 accumulate; c is T or fp32 (the gate's logits).
  template <class C>
  void gemm_nt(matrix_view<const T> a, matrix_view<const T> b, matrix_view<C> c) const {
    const auto [ws, bytes] = ctx_->next_workspace();
    EPMOE_CUDA_CHECK(cublasSetWorkspace(ctx_->blas, ws, bytes));
    cuda_detail::gemm_nt(ctx_->blas, dtype<T>::cuda, a.data, a.stride, b.data, b.stride,
                         dtype<C>::cuda, c.data, c.stride, c.rows, c.cols, a.cols, 0.f);
  }
  /// The experts' GEMMs run one cublasGemmEx per expert when the experts average at least
  /// `rows` rows (default 32), else as one grouped call (0: always per expert).
  void set_per_group_gemm_rows(index_t rows) const { ctx_->grouped.set_per_group_rows(rows); }
  index_t per_group_gemm_rows() const { return ctx_->grouped.per_group_rows(); }
  void grouped_gemm_nt(grouped_rows<const T> a, stacked_view<const T> b, grouped_rows<T> c) const {
    ctx_->grouped.run(ctx_->blas, a, b, c, ctx_->work, ctx_->next_workspace());
  }

  /// Per group g: c's rows of g (+)= a's rows of g x b[g] (b[g] row-major [K, N]: the
  /// backward's dX = dY W). One cuBLAS GEMM per non-empty group (host offsets).
  void grouped_gemm_nn(grouped_rows<const T> a, stacked_view<const T> b, grouped_rows<T> c,
                       bool accumulate = false) const {
    const auto [ws, bytes] = ctx_->next_workspace();
    EPMOE_CUDA_CHECK(cublasSetWorkspace(ctx_->blas, ws, bytes));
    for (int g = 0; g < a.groups; ++g) {
      const index_t rows = a.offsets[g + 1] - a.offsets[g], r0 = a.offsets[g] - a.offsets[0];
      if (rows == 0) continue;
      cuda_detail::gemm_nn(ctx_->blas, dtype<T>::cuda, a.data + r0 * a.stride, a.stride,
                           b.data + g * b.batch_stride, b.stride, dtype<T>::cuda,
                           c.data + r0 * c.stride, c.stride, rows, b.cols, a.cols,
                           accumulate ? 1.f : 0.f);
    }
  }
  /// Per group g: c[g] [M, N] (+)= (a's rows of g)ᵀ x (b's rows of g) (the backward's
  /// dW = dYᵀ X); c is T or fp32. A group without rows gives zeros (or leaves c[g]).
  template <class C>
  void grouped_gemm_tn_accumulate(grouped_rows<const T> a, grouped_rows<const T> b,
                                  stacked_view<C> c, bool accumulate) const {
    const auto [ws, bytes] = ctx_->next_workspace();
    EPMOE_CUDA_CHECK(cublasSetWorkspace(ctx_->blas, ws, bytes));
    for (int g = 0; g < a.groups; ++g) {
      const index_t rows = a.offsets[g + 1] - a.offsets[g], r0 = a.offsets[g] - a.offsets[0];
      C* cg = c.data + g * c.batch_stride;
      if (rows == 0) {
        if (!accumulate && c.rows > 0 && c.cols > 0)  // all-zero bits: 0 in fp32, bf16, fp16
          EPMOE_CUDA_CHECK(cudaMemset2DAsync(cg, sizeof(C) * c.stride, 0, sizeof(C) * c.cols,
                                             c.rows, ctx_->work));
        continue;
      }
      cuda_detail::gemm_tn(ctx_->blas, dtype<T>::cuda, a.data + r0 * a.stride, a.stride,
                           b.data + r0 * b.stride, b.stride, dtype<C>::cuda, cg, c.stride, c.rows,
                           c.cols, rows, accumulate ? 1.f : 0.f);
    }
  }

  // --- the stage clock: events on the work stream, read after a synchronisation ---------

  class clock {
    // A clock's own events (two layers on one space time their passes apart).
    struct events {
      explicit events(int n) : e(static_cast<std::size_t>(n)) {
        for (cudaEvent_t& x : e) EPMOE_CUDA_CHECK(cudaEventCreate(&x));
      }
      events(const events&) = delete;
      events& operator=(const events&) = delete;
      ~events() {
        for (cudaEvent_t x : e) cudaEventDestroy(x);
      }
      std::vector<cudaEvent_t> e;
    };

   public:
    using mark = int;
    clock() = default;
    clock(int n, cudaStream_t s)
        : keep_(std::make_shared<events>(n)), events_(keep_->e.data()), n_(n), stream_(s) {}
    void begin_pass() {
      next_ = 0;
      cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
      EPMOE_CUDA_CHECK(cudaStreamIsCapturing(stream_, &st));
      timed_ = st == cudaStreamCaptureStatusNone;  // a captured pass is not timed
    }
    mark now() {
      if (!timed_ || next_ >= n_) return -1;
      EPMOE_CUDA_CHECK(cudaEventRecord(events_[next_], stream_));
      return next_++;
    }
    /// Seconds from the pass's first mark to m (0 for a mark that was not recorded).
    double seconds(mark m) const {
      if (m <= 0) return 0;
      float ms = 0;
      EPMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[0], events_[m]));
      return ms * 1e-3;
    }

   private:
    std::shared_ptr<events> keep_;
    cudaEvent_t* events_ = nullptr;
    int n_ = 0, next_ = 0;
    cudaStream_t stream_ = nullptr;
    bool timed_ = true;
  };
  /// A clock with room for `marks` marks per pass.
  clock make_clock(index_t marks = 256) const {
    return clock(static_cast<int>(std::max<index_t>(marks, 2)), ctx_->work);
  }

  /// What the layer's workspace needs of the space beyond buffers: grouped GEMM calls per
  /// pass and groups per call, and keys the plan sorts and scans.
  void reserve(int grouped_calls, int max_groups, index_t scan_n) const {
    ctx_->grouped.reserve(grouped_calls, max_groups);
    ctx_->reserve_scan(scan_n);
    ctx_->reserve_workspace();  // here, not in a pass: a captured pass may not allocate
  }

  /// The pass waits for the caller's stream; the caller's later work waits for the pass.
  void enter() const {
    ctx_->grouped.begin_pass();
    ctx_->slice = 0;
    EPMOE_CUDA_CHECK(cudaEventRecord(ctx_->entered, ctx_->caller));
    EPMOE_CUDA_CHECK(cudaStreamWaitEvent(ctx_->work, ctx_->entered));
  }
  void leave() const {
    EPMOE_CUDA_CHECK(cudaEventRecord(ctx_->left, ctx_->work));
    EPMOE_CUDA_CHECK(cudaStreamWaitEvent(ctx_->caller, ctx_->left));
  }
  /// Waits for the work queued so far (on an event: only what came before).
  void synchronize() const {
    EPMOE_CUDA_CHECK(cudaEventRecord(ctx_->done, ctx_->work));
    EPMOE_CUDA_CHECK(cudaEventSynchronize(ctx_->done));
  }

 private:
  template <class F>
  void launch_rows(index_t max_n, const index_t* n, index_t width, const F& f) const {
    if (max_n <= 0 || width <= 0) return;
    constexpr index_t piece = 8;
    const index_t items = max_n * ((width + piece - 1) / piece);
    cuda_kernels::
        for_each_row<<<cuda_kernels::grid_for(items), cuda_kernels::block_threads, 0, ctx_->work>>>(
            max_n, n, width, piece, f);
    EPMOE_CUDA_CHECK(cudaGetLastError());
  }

  // Streams, handles and events of a space, shared by its copies; freed with the last.
  struct context {
    explicit context(cudaStream_t c) : caller(c) {
      EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&work, cudaStreamNonBlocking));
      EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&comm, cudaStreamNonBlocking));
      for (cudaEvent_t* e : {&entered, &left, &done})
        EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
      EPMOE_CUDA_CHECK(cublasCreate(&blas));
      EPMOE_CUDA_CHECK(cublasSetStream(blas, work));
    }
    context(const context&) = delete;
    context& operator=(const context&) = delete;
    ~context() {  // no throws from here: a failed release leaks
      cudaStreamSynchronize(work);
      for (cudaEvent_t e : {entered, left, done}) cudaEventDestroy(e);
      cublasDestroy(blas);
      cudaStreamDestroy(comm);
      cudaStreamDestroy(work);
    }
    void reserve_scan(index_t n) {
      std::size_t bytes = 0;
      EPMOE_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, bytes, static_cast<index_t*>(nullptr),
                                                     static_cast<index_t*>(nullptr),
                                                     static_cast<int>(n)));
      if (static_cast<index_t>(bytes) > scan_bytes) {
        scan_bytes = static_cast<index_t>(bytes);
        scan_buffer = device_buffer<char>(scan_bytes);
      }
    }
    void* scan_temp() const { return scan_buffer.data(); }
    // Each cuBLAS call of a pass gets its own workspace slice, so GEMMs captured in graphs
    // that run side by side never share one.
    static constexpr std::size_t slice_bytes = 4 << 20;
    int workspace_slices() const { return std::max(1, grouped.calls()); }
    void reserve_workspace() {
      const index_t bytes = workspace_slices() * static_cast<index_t>(slice_bytes);
      if (workspace.size() < bytes) workspace = device_buffer<char>(bytes);
    }
    std::pair<void*, std::size_t> next_workspace() {
      reserve_workspace();  // a no-op once reserve() ran (the layer's constructor)
      void* p = workspace.data() + (slice++ % workspace_slices()) * slice_bytes;
      return {p, slice_bytes};
    }

    cudaStream_t caller = nullptr, work = nullptr, comm = nullptr;
    cudaEvent_t entered = nullptr, left = nullptr, done = nullptr;
    cublasHandle_t blas = nullptr;
    cuda_detail::grouped_gemm grouped;
    device_buffer<char> workspace, scan_buffer;
    index_t scan_bytes = 0;
    int slice = 0;
  };
  std::shared_ptr<context> ctx_;
};

}  // namespace epmoe::space
