// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "epmoe/core/view.hpp"

#if defined(EPMOE_HAS_CBLAS)
#include <cblas.h>
#endif
#if defined(EPMOE_HAS_OPENBLAS)
extern "C" int openblas_get_num_threads(void);
extern "C" void openblas_set_num_threads(int);
#endif
#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define EPMOE_HOST_GEMM_AVX2 1
#include <immintrin.h>
#endif

namespace epmoe::space {

/// Which GEMM the host space runs, for reports.
inline const char* host_gemm_backend() {
#if defined(EPMOE_HAS_OPENBLAS)
  return "cblas_sgemm (OpenBLAS); streaming kernel for few rows";
#elif defined(EPMOE_HAS_CBLAS)
  return "cblas_sgemm (BLAS); streaming kernel for few rows";
#else
  return "portable loop (no BLAS found); streaming kernel for few rows";
#endif
}

/// Threads the BLAS runs one GEMM call on (OpenBLAS's setting; 1 with another BLAS or none).
inline int blas_threads() {
#if defined(EPMOE_HAS_OPENBLAS)
  return openblas_get_num_threads();
#else
  return 1;
#endif
}

/// Sets the BLAS's threads per call (OpenBLAS; a no-op otherwise) and returns the previous
/// count. The setting is the BLAS's, process-wide: ranks that are threads of one process share
/// it, so R ranks on C cores want about C / R each (more makes them fight for the cores).
inline int set_blas_threads(int n) {
  const int before = blas_threads();
#if defined(EPMOE_HAS_OPENBLAS)
  openblas_set_num_threads(n < 1 ? 1 : n);
#else
  (void)n;
#endif
  return before;
}

namespace detail {

/// Rows of `a` up to which host_gemm_nt streams b itself instead of calling sgemm: with few
/// rows a GEMM is bound by reading b (an expert's weights) once, which sgemm does poorly
/// (it packs all of b for a handful of rows; measured 2-5 GB/s against ~19 GB/s of reads).
inline constexpr index_t stream_max_rows = 32;

/// Threads for one streaming GEMM: the BLAS's own count (one rank = one thread otherwise),
/// and only when the call is large enough to pay for starting them.
inline int stream_threads(index_t M, index_t N, index_t K) {
  int n = 1;
#if defined(EPMOE_HAS_OPENBLAS)
  n = openblas_get_num_threads();
#endif
  if (n <= 1) return 1;
  // A wake-up (~80 us when the helpers sleep) must be small against streaming b.
  const double bytes = 4.0 * static_cast<double>(N) * static_cast<double>(K);
  if (bytes < (1 << 20) && M * N * K < (1 << 22)) return 1;
#if defined(__linux__)
  // No more threads than cores this thread may run on (mpiexec binds a rank to one core).
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) n = std::min(n, CPU_COUNT(&set));
#endif
  return std::clamp(n, 1, static_cast<int>(std::max<index_t>(1, N / 64)));
}

// c[m, n] = a[m, :] . b[n, :] for all m and n in [n0, n1): the portable kernel, 4 output
// columns at a time (4 independent sums over one a-row, which vectorise).
inline void gemm_nt_columns_portable(matrix_view<const float> a, matrix_view<const float> b,
                                     matrix_view<float> c, index_t n0, index_t n1) {
  const index_t M = c.rows, K = a.cols;
  for (index_t i = 0; i < M; ++i) {
    const float* ar = a.row(i);
    float* cr = c.row(i);
    const index_t n4 = n0 + (n1 - n0) / 4 * 4;
    index_t j = n0;
    for (; j < n4; j += 4) {
      const float *b0 = b.row(j), *b1 = b.row(j + 1), *b2 = b.row(j + 2), *b3 = b.row(j + 3);
      float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
      for (index_t k = 0; k < K; ++k) {
        const float x = ar[k];
        s0 += x * b0[k];
        s1 += x * b1[k];
        s2 += x * b2[k];
        s3 += x * b3[k];
      }
      cr[j] = s0;
      cr[j + 1] = s1;
      cr[j + 2] = s2;
      cr[j + 3] = s3;
    }
    for (; j < n1; ++j) {
      const float* br = b.row(j);
      float s = 0;
      for (index_t k = 0; k < K; ++k) s += ar[k] * br[k];
      cr[j] = s;
    }
  }
}

#if defined(EPMOE_HOST_GEMM_AVX2)
inline bool cpu_has_avx2_fma() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}

// The four sums of acc0..acc3 (8 lanes each), as one 4-lane vector.
__attribute__((target("avx2,fma"))) inline __m128 sum4(__m256 acc0, __m256 acc1, __m256 acc2,
                                                       __m256 acc3) {
  const __m256 h01 = _mm256_hadd_ps(acc0, acc1), h23 = _mm256_hadd_ps(acc2, acc3);
  const __m256 h = _mm256_hadd_ps(h01, h23);
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Lanes [0, n) set: masked loads for a row's unaligned head and its tail.
__attribute__((target("avx2,fma"), always_inline)) inline __m256i lanes_below(index_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Sums of 2 a-rows times 4 b-rows, 8 lanes each.
struct dot_2x4 {
  __m256 s00, s01, s02, s03, s10, s11, s12, s13;
};

template <bool Masked>
__attribute__((target("avx2,fma"), always_inline)) inline __m256 load8(const float* p, __m256i m) {
  if constexpr (Masked)
    return _mm256_maskload_ps(p, m);
  else
    return _mm256_loadu_ps(p);
}

// One step of 8 columns from k (lanes outside `mask` read as 0 when Masked).
template <bool Masked, bool Two>
__attribute__((target("avx2,fma"), always_inline)) inline void dot_step(
    dot_2x4& d, const float* x0, const float* x1, const float* b0, const float* b1, const float* b2,
    const float* b3, index_t k, __m256i mask) {
  const __m256 w0 = load8<Masked>(b0 + k, mask), w1 = load8<Masked>(b1 + k, mask);
  const __m256 w2 = load8<Masked>(b2 + k, mask), w3 = load8<Masked>(b3 + k, mask);
  const __m256 u = load8<Masked>(x0 + k, mask);
  d.s00 = _mm256_fmadd_ps(w0, u, d.s00);
  d.s01 = _mm256_fmadd_ps(w1, u, d.s01);
  d.s02 = _mm256_fmadd_ps(w2, u, d.s02);
  d.s03 = _mm256_fmadd_ps(w3, u, d.s03);
  if constexpr (Two) {
    const __m256 v = load8<Masked>(x1 + k, mask);
    d.s10 = _mm256_fmadd_ps(w0, v, d.s10);
    d.s11 = _mm256_fmadd_ps(w1, v, d.s11);
    d.s12 = _mm256_fmadd_ps(w2, v, d.s12);
    d.s13 = _mm256_fmadd_ps(w3, v, d.s13);
  }
}

// c0 (and c1 when Two)[0..4) = dots over all K columns: a masked head up to where b's rows
// are 32-byte aligned (a load that splits a cache line costs two), aligned steps, a masked
// tail. With `next` (the next 4 rows of b), they are prefetched, one cache line per row every
// 16 columns: a row is a new page, which the hardware prefetchers do not reach from here.
template <bool Two, bool Prefetch>
__attribute__((target("avx2,fma"))) inline void dot_rows(const float* x0, const float* x1,
                                                         const float* b0, const float* b1,
                                                         const float* b2, const float* b3,
                                                         const float* const* next, index_t K,
                                                         index_t k0, float* c0, float* c1) {
  const __m256 z = _mm256_setzero_ps();
  dot_2x4 d{z, z, z, z, z, z, z, z};
  index_t k = 0;
  if (k0 > 0) dot_step<true, Two>(d, x0, x1, b0, b1, b2, b3, 0, lanes_below(k0)), k = k0;
  for (; k + 16 <= K; k += 16) {
    if constexpr (Prefetch)
      for (int q = 0; q < 4; ++q)
        _mm_prefetch(reinterpret_cast<const char*>(next[q] + k), _MM_HINT_T1);
    dot_step<false, Two>(d, x0, x1, b0, b1, b2, b3, k, __m256i{});
    dot_step<false, Two>(d, x0, x1, b0, b1, b2, b3, k + 8, __m256i{});
  }
  if constexpr (Prefetch)
    for (int q = 0; q < 4; ++q)
      _mm_prefetch(reinterpret_cast<const char*>(next[q] + K - 1), _MM_HINT_T1);
  if (k + 8 <= K) dot_step<false, Two>(d, x0, x1, b0, b1, b2, b3, k, __m256i{}), k += 8;
  if (k < K) dot_step<true, Two>(d, x0, x1, b0, b1, b2, b3, k, lanes_below(K - k));
  _mm_storeu_ps(c0, sum4(d.s00, d.s01, d.s02, d.s03));
  if constexpr (Two) _mm_storeu_ps(c1, sum4(d.s10, d.s11, d.s12, d.s13));
}

// Streaming kernel: each block of 4 rows of b is read from memory once and then dotted with
// every row of a, two at a time, from cache (8 accumulators, 8 lanes each).
// fixed_order: no alignment head (k0 = 0), so every dot sums in an order that depends on K
// alone, not on where the weights happen to be allocated (layer_options::deterministic).
__attribute__((target("avx2,fma"))) inline void gemm_nt_columns_avx2(matrix_view<const float> a,
                                                                     matrix_view<const float> b,
                                                                     matrix_view<float> c,
                                                                     index_t n0, index_t n1,
                                                                     bool fixed_order) {
  const index_t M = c.rows, K = a.cols;
  index_t j = n0;
  for (; j + 4 <= n1; j += 4) {
    const float *b0 = b.row(j), *b1 = b.row(j + 1), *b2 = b.row(j + 2), *b3 = b.row(j + 3);
    const auto misalign = reinterpret_cast<std::uintptr_t>(b0) % 32;
    const index_t k0 = fixed_order || misalign % 4
                           ? 0
                           : std::min<index_t>(K, static_cast<index_t>((32 - misalign) % 32 / 4));
    // The first pass over these rows prefetches the next 4 (from this thread's range).
    const bool more = j + 8 <= n1;
    const float* next[4] = {more ? b.row(j + 4) : b0, more ? b.row(j + 5) : b1,
                            more ? b.row(j + 6) : b2, more ? b.row(j + 7) : b3};
    index_t i = 0;
    for (; i + 2 <= M; i += 2) {
      if (i == 0 && more)
        dot_rows<true, true>(a.row(i), a.row(i + 1), b0, b1, b2, b3, next, K, k0, c.row(i) + j,
                             c.row(i + 1) + j);
      else
        dot_rows<true, false>(a.row(i), a.row(i + 1), b0, b1, b2, b3, next, K, k0, c.row(i) + j,
                              c.row(i + 1) + j);
    }
    if (i < M) {
      if (i == 0 && more)
        dot_rows<false, true>(a.row(i), nullptr, b0, b1, b2, b3, next, K, k0, c.row(i) + j,
                              nullptr);
      else
        dot_rows<false, false>(a.row(i), nullptr, b0, b1, b2, b3, next, K, k0, c.row(i) + j,
                               nullptr);
    }
  }
  const index_t K8 = K & ~index_t{7};
  for (; j < n1; ++j) {  // the last N % 4 columns
    const float* br = b.row(j);
    for (index_t i = 0; i < M; ++i) {
      const float* x0 = a.row(i);
      __m256 s = _mm256_setzero_ps();
      for (index_t k = 0; k < K8; k += 8)
        s = _mm256_fmadd_ps(_mm256_loadu_ps(br + k), _mm256_loadu_ps(x0 + k), s);
      alignas(32) float r[8];
      _mm256_store_ps(r, s);
      float t = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
      for (index_t k = K8; k < K; ++k) t += x0[k] * br[k];
      c.row(i)[j] = t;
    }
  }
}

#endif

inline void gemm_nt_columns(matrix_view<const float> a, matrix_view<const float> b,
                            matrix_view<float> c, index_t n0, index_t n1,
                            bool fixed_order = false) {
#if defined(EPMOE_HOST_GEMM_AVX2)
  if (cpu_has_avx2_fma()) return gemm_nt_columns_avx2(a, b, c, n0, n1, fixed_order);
#else
  (void)fixed_order;
#endif
  gemm_nt_columns_portable(a, b, c, n0, n1);
}

/// Helper threads for the streaming kernel, started on first use and kept (starting a thread
/// costs ~70 us here, as much as streaming 1 MB). A job is cut into chunks that the caller and
/// the helpers take in turn, so the caller finishes alone when a helper does not get a core
/// (another process, another rank thread). A helper that finished spins (yielding) for the
/// next job for ~100 us before it sleeps: waking a sleeping thread takes ~80 us on this VM,
/// and the GEMMs of a forward pass come back to back. One job at a time: a caller that finds
/// the helpers busy runs its job alone.
class stream_helpers {
 public:
  stream_helpers() = default;
  stream_helpers(const stream_helpers&) = delete;
  stream_helpers& operator=(const stream_helpers&) = delete;

  /// Runs job(c) for every chunk c in [0, chunks), on the caller and up to threads - 1
  /// helpers. False (and nothing run) when the helpers are busy.
  template <class Job>
  bool run(int threads, int chunks, const Job& job) {
    std::unique_lock busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    std::uint64_t gen;
    {
      std::lock_guard lock(mutex_);
      while (static_cast<int>(threads_.size()) < threads - 1)
        threads_.emplace_back([this] { serve(); });
      keep_off_callers_core();
      job_ = [&job](int c) { job(c); };
      chunks_ = chunks;
      done_.store(0, std::memory_order_relaxed);
      gen = ++generation_ & 0xffffffffu;
      ticket_.store(gen << 32, std::memory_order_release);
    }
    wake_.notify_all();
    work(gen, chunks, job);
    const auto finished = [&] { return done_.load(std::memory_order_acquire) == chunks; };
    if (!spin_until(finished)) {
      std::unique_lock lock(mutex_);
      finished_.wait(lock, finished);
    }
    return true;
  }

  ~stream_helpers() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }

 private:
  // Takes chunks of job `gen` (the ticket holds the job's generation and its next chunk)
  // until none is left; whoever finishes the last one wakes the caller.
  template <class Job>
  void work(std::uint64_t gen, int chunks, const Job& job) {
    for (;;) {
      std::uint64_t t = ticket_.load(std::memory_order_acquire);
      do {
        if (t >> 32 != gen || static_cast<int>(t & 0xffffffffu) >= chunks) return;
      } while (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel));
      job(static_cast<int>(t & 0xffffffffu));
      if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == chunks) {
        std::lock_guard lock(mutex_);  // the caller checks done_ under it before sleeping
        finished_.notify_one();
      }
    }
  }

  // Linux puts a woken thread next to the thread that woke it when it last ran there; a helper
  // on the caller's core takes turns with it instead of running beside it (measured: no gain
  // at all half of the time). So the helpers may run on any core the caller may, but not on
  // the one it is on now (updated when the caller moves).
  void keep_off_callers_core() {
#if defined(__linux__)
    const int cpu = sched_getcpu();
    if (cpu < 0 || cpu == avoided_cpu_) return;
    avoided_cpu_ = cpu;
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) != 0 || !CPU_ISSET(cpu, &set) || CPU_COUNT(&set) < 2)
      return;
    CPU_CLR(cpu, &set);
    for (auto& t : threads_) pthread_setaffinity_np(t.native_handle(), sizeof set, &set);
#endif
  }

  // Polls `ready` for ~100 us, yielding the core (a helper may share the caller's); true once
  // it holds.
  template <class Ready>
  static bool spin_until(const Ready& ready) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0;; ++i) {
      if (ready()) return true;
      std::this_thread::yield();
      if (i % 16 == 15 && std::chrono::steady_clock::now() - start > std::chrono::microseconds(100))
        return ready();
    }
  }

  void serve() {
    std::uint64_t seen = 0;
    for (;;) {
      const auto fresh = [&] {
        return stop_ || (generation_.load(std::memory_order_acquire) & 0xffffffffu) != seen;
      };
      if (!spin_until([&] {
            return (generation_.load(std::memory_order_acquire) & 0xffffffffu) != seen;
          })) {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, fresh);
        if (stop_) return;
      }
      std::function<void(int)> job;
      int chunks;
      {
        std::lock_guard lock(mutex_);
        if (stop_) return;
        seen = generation_ & 0xffffffffu;
        job = job_;
        chunks = chunks_;
      }
      work(seen, chunks, job);
    }
  }

  std::mutex busy_, mutex_;
  std::condition_variable wake_, finished_;
  std::vector<std::thread> threads_;
  std::function<void(int)> job_;
  int chunks_ = 0;
  std::atomic<int> done_{0};
  std::atomic<std::uint64_t> generation_{0}, ticket_{0};
  bool stop_ = false;     // under mutex_
  int avoided_cpu_ = -1;  // the caller's core the helpers were last kept off
};

/// c = a b^T by streaming b: its rows cut into chunks of >= 64 (a multiple of 4) that
/// `threads` threads take in turn (the caller and `helpers`; none: the caller alone).
inline void gemm_nt_stream(matrix_view<const float> a, matrix_view<const float> b,
                           matrix_view<float> c, int threads, stream_helpers* helpers,
                           bool fixed_order = false) {
  const index_t N = c.cols;
  const int chunks = static_cast<int>(std::clamp<index_t>(N / 64, 1, 4 * threads));
  const auto chunk = [&](int q) {
    const auto edge = [&](int e) { return e == chunks ? N : (N * e / chunks) & ~index_t{3}; };
    gemm_nt_columns(a, b, c, edge(q), edge(q + 1), fixed_order);
  };
  if (threads <= 1 || chunks == 1 || !helpers || !helpers->run(threads, chunks, chunk))
    gemm_nt_columns(a, b, c, 0, N, fixed_order);
}

}  // namespace detail

/// c[M,N] = a[M,K] * b[N,K]^T, row-major with strides. Few rows (M <= 32): a streaming kernel
/// that reads b once (on the caller and `helpers`' threads); more: BLAS sgemm when the build
/// found one, else the portable loop. `fixed_order`: sums whose order depends on the shapes
/// alone (the streaming kernel skips its alignment head), bit-identical wherever b lives.
inline void host_gemm_nt(matrix_view<const float> a, matrix_view<const float> b,
                         matrix_view<float> c, detail::stream_helpers* helpers = nullptr,
                         bool fixed_order = false) {
  const index_t M = c.rows, N = c.cols, K = a.cols;
  if (M == 0 || N == 0) return;
#if defined(EPMOE_HAS_CBLAS)
  if (M > detail::stream_max_rows) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(M), static_cast<int>(N),
                static_cast<int>(K), 1.0f, a.data, static_cast<int>(a.stride), b.data,
                static_cast<int>(b.stride), 0.0f, c.data, static_cast<int>(c.stride));
    return;
  }
#endif
  detail::gemm_nt_stream(a, b, c, detail::stream_threads(M, N, K), helpers, fixed_order);
}

namespace detail {

/// c[M,N] (+)= a[M,K] * b[K,N] (b row-major [K, N]): the portable loop (rows of b scaled
/// into rows of c, which vectorise).
inline void gemm_nn_portable(matrix_view<const float> a, matrix_view<const float> b,
                             matrix_view<float> c, bool accumulate) {
  const index_t M = c.rows, N = c.cols, K = a.cols;
  for (index_t i = 0; i < M; ++i) {
    float* cr = c.row(i);
    if (!accumulate) std::fill_n(cr, N, 0.f);
    const float* ar = a.row(i);
    for (index_t k = 0; k < K; ++k) {
      const float x = ar[k];
      const float* br = b.row(k);
      for (index_t j = 0; j < N; ++j) cr[j] += x * br[j];
    }
  }
}

/// c[M,N] (+)= a[R,M]^T * b[R,N]: the portable loop (a sum over the R rows of a and b).
inline void gemm_tn_portable(matrix_view<const float> a, matrix_view<const float> b,
                             matrix_view<float> c, bool accumulate) {
  const index_t M = c.rows, N = c.cols, R = a.rows;
  if (!accumulate)
    for (index_t i = 0; i < M; ++i) std::fill_n(c.row(i), N, 0.f);
  for (index_t r = 0; r < R; ++r) {
    const float* ar = a.row(r);
    const float* br = b.row(r);
    for (index_t i = 0; i < M; ++i) {
      const float x = ar[i];
      float* cr = c.row(i);
      for (index_t j = 0; j < N; ++j) cr[j] += x * br[j];
    }
  }
}

}  // namespace detail

/// c[M,N] (+)= a[M,K] * b[K,N], row-major with strides (b not transposed: the backward's
/// dX = dY W). BLAS sgemm when the build found one, else the portable loop.
inline void host_gemm_nn(matrix_view<const float> a, matrix_view<const float> b,
                         matrix_view<float> c, bool accumulate = false) {
  const index_t M = c.rows, N = c.cols;
  if (M == 0 || N == 0) return;
#if defined(EPMOE_HAS_CBLAS)
  if (const index_t K = a.cols; K > 0) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(M), static_cast<int>(N),
                static_cast<int>(K), 1.0f, a.data, static_cast<int>(a.stride), b.data,
                static_cast<int>(b.stride), accumulate ? 1.0f : 0.0f, c.data,
                static_cast<int>(c.stride));
    return;
  }
#endif
  detail::gemm_nn_portable(a, b, c, accumulate);
}

/// c[M,N] (+)= a[R,M]^T * b[R,N] (the backward's dW = dYᵀ X over a group's R rows; R = 0
/// gives zeros, or leaves c when accumulating). BLAS sgemm when found, else the portable loop.
inline void host_gemm_tn(matrix_view<const float> a, matrix_view<const float> b,
                         matrix_view<float> c, bool accumulate = false) {
  const index_t M = c.rows, N = c.cols;
  if (M == 0 || N == 0) return;
#if defined(EPMOE_HAS_CBLAS)
  if (const index_t R = a.rows; R > 0) {
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(M), static_cast<int>(N),
                static_cast<int>(R), 1.0f, a.data, static_cast<int>(a.stride), b.data,
                static_cast<int>(b.stride), accumulate ? 1.0f : 0.0f, c.data,
                static_cast<int>(c.stride));
    return;
  }
#endif
  detail::gemm_tn_portable(a, b, c, accumulate);
}

}  // namespace epmoe::space
