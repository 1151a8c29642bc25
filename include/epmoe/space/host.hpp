// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "epmoe/core/view.hpp"
#include "epmoe/space/host_gemm.hpp"
#include "epmoe/space/host_packed_weights.hpp"
#include "epmoe/space/host_unbacked.hpp"

namespace epmoe::space {

namespace detail {

#if defined(EPMOE_HOST_GEMM_AVX2)
// exp(x), 8 lanes: x = n ln2 + r, |r| <= ln2/2, exp(r) by Cephes' expf polynomial (~1 ulp),
// times 2^n through the exponent bits. Inputs past 88 give +inf, below -87 give ~1e-38.
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  const __m256 big = _mm256_cmp_ps(x, _mm256_set1_ps(88.f), _CMP_GT_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.f)), _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_blendv_ps(y, _mm256_set1_ps(HUGE_VALF), big);
}

// a[i] = silu(a[i]) * b[i] = a[i] / (1 + exp(-a[i])) * b[i], 8 at a time.
__attribute__((target("avx2,fma"))) inline void silu_mul_avx2(float* a, const float* b, index_t n) {
  index_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(a + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
    const __m256 s = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e));
    _mm256_storeu_ps(a + i, _mm256_mul_ps(s, _mm256_loadu_ps(b + i)));
  }
  for (; i < n; ++i) a[i] = a[i] / (1.f + std::exp(-a[i])) * b[i];
}
#endif

}  // namespace detail

/// Owning host array, zero-initialised, sized once.
template <class T>
class host_buffer {
 public:
  host_buffer() = default;
  explicit host_buffer(index_t n)
      : data_(n > 0 ? new T[static_cast<std::size_t>(n)]() : nullptr), size_(n) {}
  T* data() const { return data_.get(); }
  index_t size() const { return size_; }

 private:
  std::unique_ptr<T[]> data_;
  index_t size_ = 0;
};

/// An array both the space's stages and host code read: on the host, one array.
template <class T>
class host_mirror {
 public:
  host_mirror() = default;
  explicit host_mirror(index_t n) : buf_(n) {}
  T* device() const { return buf_.data(); }  // what the space's stages read and write
  T* host() const { return buf_.data(); }    // what host code reads and writes
  index_t size() const { return buf_.size(); }

 private:
  host_buffer<T> buf_;
};

/// Host execution: memory is ordinary heap memory, loops run on the calling thread (one
/// rank = one thread), GEMMs go to BLAS when found (EPMOE_HAS_CBLAS), else a portable loop.
/// GEMMs of few rows stream their weights on this space's own helper threads: copies of one
/// space share them; two spaces (two layers built apart) each have their own.
class host : public allocates<host> {
 public:
  using value_type = float;
  template <class T>
  using buffer = host_buffer<T>;
  template <class T>
  using mirror = host_mirror<T>;

  host() : helpers_(std::make_shared<detail::stream_helpers>()) {}

  /// Elements [first, first + n) of a mirror to the host, or to the space's memory: on the
  /// host one memory, nothing to copy.
  template <class T>
  void to_host(const mirror<T>&, index_t, index_t) const {}
  template <class T>
  void to_device(const mirror<T>&, index_t, index_t) const {}

  /// f(i) for i in [0, n): the per-element EPMOE_HD functors of the layer.
  template <class F>
  void for_each(index_t n, F&& f) const {
    for (index_t i = 0; i < n; ++i) f(i);
  }
  /// f(i, 0, width) for each row i in [0, n): row functors see whole rows here (the inner
  /// loop vectorises); a device space hands out pieces of rows to its threads.
  template <class F>
  void for_each_row(index_t n, index_t width, F&& f) const {
    for (index_t i = 0; i < n; ++i) f(i, index_t{0}, width);
  }

  /// The same for the first *n rows, n read from the space's memory (a count a stage before
  /// wrote there, which the host has not seen yet on a device); at most max_n.
  template <class F>
  void for_each_row_n(const index_t* n, index_t max_n, index_t width, F&& f) const {
    for_each_row(std::min(*n, max_n), width, f);
  }

  template <class T>
  void fill(T* p, index_t n, T value) const {
    std::fill_n(p, n, value);
  }

  /// c[M,N] = a[M,K] * b[N,K]^T (row-major; b is a PyTorch-style [out, in] weight).
  void gemm_nt(matrix_view<const float> a, matrix_view<const float> b, matrix_view<float> c) const {
    host_gemm_nt(a, b, c, helpers_.get(), fixed_order_);
  }
  /// Per group g: c's rows of g = a's rows of g x b[g]^T (the local experts' GEMMs). When b
  /// is packed (use_packed), every group's panels in one job over the helper threads.
  void grouped_gemm_nt(grouped_rows<const float> a, stacked_view<const float> b,
                       grouped_rows<float> c) const {
    if (packed_)
      if (const packed_nt* pb = packed_->find(b)) return grouped_gemm_nt_packed(a, b, pb, c);
    for (int g = 0; g < a.groups; ++g)
      if (a.offsets[g + 1] > a.offsets[g]) gemm_nt(a.group(g), b[g], c.group(g));
  }

  /// Reads the weights `p` holds packed copies of from those copies (nullptr: from the
  /// weights). `p` belongs to the caller (the layer) and must outlive its use here.
  void use_packed(const packed_weights* p) { packed_ = p; }
  using packed_store = packed_weights;
  /// The packed kernel's instructions: the best this CPU runs, or another it runs (tests).
  void set_cpu_path(cpu_path p) { path_ = cpu_runs(p) ? p : best_cpu_path(); }
  cpu_path kernel_path() const { return path_; }

  /// Per group g: c's rows of g (+)= a's rows of g x b[g] (b[g] row-major [K, N], not
  /// transposed: the backward's dX = dY W). Empty groups are skipped.
  /// With bf16 packed copies of b, b's rounded values: the backward of the forward that ran.
  void grouped_gemm_nn(grouped_rows<const float> a, stacked_view<const float> b,
                       grouped_rows<float> c, bool accumulate = false) const {
    const packed_nt* pb = packed_ ? packed_->find(b) : nullptr;
    const bool rounded = pb && pb->precision() == weights_format::bf16;
    for (int g = 0; g < a.groups; ++g)
      if (a.offsets[g + 1] > a.offsets[g])
        host_gemm_nn(a.group(g), rounded ? packed_->unpacked(pb[g]) : b[g], c.group(g), accumulate);
  }
  /// Per group g: c[g] [M, N] (+)= (a's rows of g)ᵀ x (b's rows of g) (the backward's
  /// dW = dYᵀ X, summed over the group's rows); a group without rows gives zeros (or leaves
  /// c[g] when accumulating).
  void grouped_gemm_tn_accumulate(grouped_rows<const float> a, grouped_rows<const float> b,
                                  stacked_view<float> c, bool accumulate) const {
    for (int g = 0; g < a.groups; ++g) host_gemm_tn(a.group(g), b.group(g), c[g], accumulate);
  }

  /// Copies `count[i]` rows from src row `src_offset[i]` to dst row `dst_offset[i]`, for
  /// each of n blocks (the regroup between source-major and expert-major layouts).
  void copy_blocks(matrix_view<const float> src, matrix_view<float> dst, index_t n,
                   const index_t* src_offset, const index_t* dst_offset,
                   const index_t* count) const {
    for (index_t i = 0; i < n; ++i)
      for (index_t r = 0; r < count[i]; ++r)
        std::memcpy(dst.row(dst_offset[i] + r), src.row(src_offset[i] + r),
                    static_cast<std::size_t>(src.cols) * sizeof(float));
  }

  // --- the plan's primitives: a histogram, a scan and a stable sort of small keys ---------

  /// Bytes of scratch sort_by_key needs for n keys in [0, bins].
  static index_t sort_scratch_bytes(index_t, index_t bins) {
    return static_cast<index_t>(sizeof(index_t)) * (bins + 2);
  }
  /// out[b] = number of keys equal to b, for b in [0, bins); other keys are not counted.
  void count(const std::int32_t* keys, index_t n, index_t bins, index_t* out) const {
    std::fill_n(out, bins, index_t{0});
    for (index_t i = 0; i < n; ++i)
      if (keys[i] >= 0 && keys[i] < bins) ++out[keys[i]];
  }
  /// out[i] = in[0] + ... + in[i-1] for i in [0, n]: out has n + 1 entries, out[n] the total.
  void exclusive_scan(const index_t* in, index_t* out, index_t n) const {
    index_t sum = 0;
    for (index_t i = 0; i < n; ++i) {
      const index_t v = in[i];
      out[i] = sum;
      sum += v;
    }
    out[n] = sum;
  }
  /// Stable sort of positions [0, n) by keys in [0, bins]: sorted_keys[p] and order[p] (the
  /// position that went to p). A counting sort here (CUB's radix sort on a device).
  void sort_by_key(const std::int32_t* keys, index_t n, index_t bins, std::int32_t* sorted_keys,
                   std::int32_t* order, void* scratch) const {
    index_t* next = static_cast<index_t*>(scratch);  // [bins + 2]
    std::fill_n(next, bins + 2, index_t{0});
    for (index_t i = 0; i < n; ++i) ++next[keys[i] + 1];
    for (index_t b = 0; b <= bins; ++b) next[b + 1] += next[b];
    for (index_t i = 0; i < n; ++i) {
      const index_t p = next[keys[i]]++;
      sorted_keys[p] = keys[i];
      order[p] = static_cast<std::int32_t>(i);
    }
  }

  /// a[i] = silu(a[i]) * b[i] for i in [0, n): SwiGLU's gate, vectorised (a fast exp within
  /// ~2 ulp of expf) where the CPU has AVX2, else the same formula as expert::silu_mul.
  void silu_mul(float* a, const float* b, index_t n) const {
#if defined(EPMOE_HOST_GEMM_AVX2)
    if (detail::cpu_has_avx2_fma()) return detail::silu_mul_avx2(a, b, n);
#endif
    for (index_t i = 0; i < n; ++i) a[i] = a[i] / (1.f + std::exp(-a[i])) * b[i];
  }

  /// The stage clock: marks are seconds since the pass began, known at once.
  class clock {
   public:
    using mark = double;
    void begin_pass() { start_ = std::chrono::steady_clock::now(); }
    mark now() const {
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    }
    /// Seconds since the pass began at `m` (after synchronize() on a device space).
    double seconds(mark m) const { return m; }

   private:
    std::chrono::steady_clock::time_point start_{};
  };
  /// A clock (any number of marks).
  clock make_clock(index_t = 0) const { return {}; }
  /// What a layer needs beyond buffers (a device's GEMM and scan storage): nothing here.
  void reserve(int, int, index_t) const {}

  /// Orders the layer's pass after the caller's work and the caller's after the pass: on
  /// the host both run on the calling thread already.
  void enter() const {}
  void leave() const {}
  void synchronize() const {}

  /// Fixed-order sums (layer_options::deterministic): every result bit-identical from run to
  /// run whatever the buffers' alignment; BLAS and the portable loops already are.
  void set_fixed_order(bool on) { fixed_order_ = on; }
  bool fixed_order() const { return fixed_order_; }

  /// The helper threads of this space (shared by its copies).
  detail::stream_helpers* helpers() const { return helpers_.get(); }

 private:
  // The groups' GEMMs over packed b: chunks of (group, panels) that the caller and the
  // helpers take in turn, so small experts share one wake-up and large ones split.
  void grouped_gemm_nt_packed(grouped_rows<const float> a, stacked_view<const float> weights,
                              const packed_nt* b, grouped_rows<float> c) const {
    const index_t panels = b[0].panels(), K = b[0].cols();
    // A group of many rows goes to sgemm (which packs b itself, and then runs a little
    // faster than the panel kernel: epmoe_bench_gemm); the others to one packed job.
    // (fp32 copies only: bf16 ones compute with their rounded values at every row count.)
    const bool to_blas = has_blas && b[0].precision() == weights_format::fp32;
    const auto packed_rows = [&](int g) {
      const index_t n = a.offsets[g + 1] - a.offsets[g];
      return to_blas && n > packed_max_rows ? index_t{0} : n;
    };
    index_t rows = 0, active = 0;
    for (int g = 0; g < a.groups; ++g) {
      if (packed_rows(g) == 0 && a.offsets[g + 1] > a.offsets[g])
        gemm_nt(a.group(g), weights[g], c.group(g));
      const index_t n = packed_rows(g);
      rows += n;
      active += n > 0;
    }
    if (active == 0) return;
    const int threads = detail::stream_threads(std::max<index_t>(rows, 2), b[0].rows(), K);
    // Act-order copies (packed_nt::input_order; group-wise, so none went to sgemm above)
    // multiply their inputs gathered in that order: every group's rows, once per call, over
    // the helper threads, into the store's room (reserved with the order).
    if (std::any_of(b, b + a.groups, [](const packed_nt& m) { return !m.input_order().empty(); })) {
      float* room = packed_->gathered_inputs(a.rows() * K);
      const auto gather = [&](int g) {
        gather_inputs(a.group(g), b[g], room + (a.offsets[g] - a.offsets[0]) * K);
      };
      if (!(threads > 1 && helpers_->run(threads, a.groups, gather)))
        for (int g = 0; g < a.groups; ++g) gather(g);
      a = {room, K, K, a.groups, a.offsets, a.device_offsets, 1};
    }
    // AVX512-BF16 multiplies bf16 by bf16, int8 VNNI u8 by s8: the rows converted once,
    // here, for every panel of every piece.
    converted_rows a16;
    if (const index_t words = packed_input_words(b[0].precision(), K, path_)) {
      std::uint32_t* out = packed_->input_words(a.rows(), words);
      float* scales = packed_->input_scales(a.rows());
      a16 = {out, words, scales};
      const auto convert = [&](int g) {
        const index_t at = a.offsets[g] - a.offsets[0];
        if (packed_rows(g) > 0)
          convert_inputs(a.group(g), b[0], path_, out + at * words, words, scales + at);
      };
      if (!(threads > 1 && helpers_->run(threads, a.groups, convert)))
        for (int g = 0; g < a.groups; ++g) convert(g);
    }
    // Pieces per group: about 16 chunks per thread over the active groups, so that experts
    // of unequal rows still share the threads evenly (4 per thread left one thread ~30% of a
    // Mixtral-like T=128 pass alone).
    const index_t pieces = std::clamp<index_t>((16 * threads + active - 1) / active, 1, panels);
    const auto job = [&](int q) {
      const int g = static_cast<int>(q / pieces);
      const index_t piece = q % pieces;
      if (packed_rows(g) == 0) return;
      const index_t at = a.offsets[g] - a.offsets[0];
      const converted_rows ag{a16.data ? a16.data + at * a16.stride : nullptr, a16.stride,
                              a16.scales ? a16.scales + at : nullptr};
      gemm_nt_packed(a.group(g), ag, b[g], c.group(g), panels * piece / pieces,
                     panels * (piece + 1) / pieces, path_);
    };
    const int chunks = static_cast<int>(a.groups * pieces);
    if (threads > 1 && helpers_->run(threads, chunks, job)) return;
    for (int q = 0; q < chunks; ++q) job(q);
  }

#if defined(EPMOE_HAS_CBLAS)
  static constexpr bool has_blas = true;
#else
  static constexpr bool has_blas = false;
#endif
  static constexpr index_t packed_max_rows = 160;

  std::shared_ptr<detail::stream_helpers> helpers_;
  const packed_weights* packed_ = nullptr;
  cpu_path path_ = best_cpu_path();
  bool fixed_order_ = false;
};

}  // namespace epmoe::space
