// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// moe_layer<Policies> when Policies::space is space::cuda<T>: the same composition of the
// same policies as the host layer, with the stages on the rank's stream.
//
//   route   gate GEMM (cuBLAS, fp32 logits), then the router's EPMOE_HD route_token, one
//           thread per token (rows::route_tokens, the host's functor)
//   plan    slot key per assignment (the placement's EPMOE_HD slot_for), CUB stable radix
//           sort by slot (token order, then k: the host's drop order), per-slot counts and
//           CUB scans, capacity and drops applied on the device
//   counts  each destination's per-slot rows exchanged (device for NCCL; the host for
//           in-process ranks), then ONE device->host copy + stream sync tells the host the
//           sizes (dynamic mode). Static mode (padded capacity on comm::local or comm::nccl):
//           every size is known, nothing waits for the host, the pass can be graph-captured
//   permute gather token rows into the send buffer (16-byte vectors)
//   dispatch rows land expert-major in the receiver's buffer, block by block: no regroup
//   experts grouped GEMM (cublasGemmGroupedBatchedEx) of every local expert's rows, fused
//           SiLU-mul (expert::silu_mul), grouped down projection
//   combine the reverse exchange into the sender's send buffer
//   reduce  y[t] = sum_k w[t,k] out[t,k] (+ shared experts), fp32 accumulate
//
// Batch routers (expert choice, Sinkhorn) decide over the whole batch on the host: the
// logits come down, route_batch runs, the routing goes back up (a sync per pass). Router
// losses are computed on the host when stats() is read. Not on the device yet (a
// static_assert or config_error says so): per-rank dedup, more than one chunk, live
// re-placement.
#include <algorithm>
#include <cstdint>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>
#include <exception>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "epmoe/comm/threads.hpp"
#include "epmoe/core/agreement.hpp"
#include "epmoe/core/rows.hpp"
#include "epmoe/cuda/exchange.cuh"
#include "epmoe/cuda/grouped_gemm.cuh"
#include "epmoe/cuda/kernels.cuh"
#include "epmoe/moe_layer.hpp"
#include "epmoe/placement/table.hpp"
#include "epmoe/space/cuda.cuh"

namespace epmoe {

namespace cuda_detail {

/// The placement as device code: stateless placements travel by value; a table's arrays
/// are copied to device memory once and seen through a table_view.
template <class P>
struct device_placement {
  explicit device_placement(const P& p) : view(p) {}
  P view;
};
template <>
struct device_placement<placement::table> {
  explicit device_placement(const placement::table& t)
      : phy(static_cast<index_t>(t.phy_to_log().size())),
        log(static_cast<index_t>(t.log_to_phy().size())),
        copies(static_cast<index_t>(t.log_to_phy().size()) / t.max_copies()) {
    const placement::table_view h = t.view();
    const index_t E = copies.size();
    upload(phy, t.phy_to_log().data());
    upload(log, t.log_to_phy().data());
    EPMOE_CUDA_CHECK(cudaMemcpy(copies.data(), h.copies, sizeof(int) * E, cudaMemcpyHostToDevice));
    // cudaMemcpy from pageable memory may return before the copy lands; the layer's own
    // (non-blocking) stream would not wait for it.
    EPMOE_CUDA_CHECK(cudaDeviceSynchronize());
    view = h;
    view.phy_to_log = phy.data();
    view.log_to_phy = log.data();
    view.copies = copies.data();
  }
  static void upload(device_buffer<int>& d, const int* h) {
    EPMOE_CUDA_CHECK(cudaMemcpy(d.data(), h, sizeof(int) * d.size(), cudaMemcpyHostToDevice));
  }
  device_buffer<int> phy, log, copies;
  placement::table_view view;
};

/// c [M, N] (row-major, ldc, type C) = a [M, K] x b [N, K]^T (type A), fp32 accumulate.
inline void gemm_nt(cublasHandle_t h, cudaDataType_t ab, const void* a, index_t lda, const void* b,
                    index_t ldb, cudaDataType_t ct, void* c, index_t ldc, index_t M, index_t N,
                    index_t K, float beta) {
  if (M == 0 || N == 0) return;
  const float alpha = 1.f;
  EPMOE_CUDA_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(N),
                                static_cast<int>(M), static_cast<int>(K), &alpha, b, ab,
                                static_cast<int>(ldb), a, ab, static_cast<int>(lda), &beta, c, ct,
                                static_cast<int>(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

/// Switch jitter on the device: the gate reads x * U(1-eps, 1+eps) (the router's factor).
/// (A kernel's functor may not be a private member type, hence here.)
template <class Router, class T>
struct jitter_input {
  Router router;
  matrix_view<const T> x;
  T* out;
  const std::int64_t* ids;
  std::int64_t first;
  std::uint64_t pass;
  EPMOE_HD void operator()(index_t i) const {
    const index_t t = i / x.cols, h = i % x.cols;
    out[i] = from_float<T>(to_float(x(t, h)) * router.factor(pass, ids ? ids[t] : first + t, h));
  }
};

}  // namespace cuda_detail

template <class Policies>
requires device_space<typename Policies::space>
class moe_layer<Policies> {
 public:
  using space_type = typename Policies::space;
  using value_type = typename space_type::value_type;
  using router_type = typename Policies::router;
  using placement_type = typename Policies::placement;
  using capacity_type = typename Policies::capacity;
  using comm_type = typename Policies::comm;
  using expert_type = typename Policies::expert;
  using schedule_type = typename Policies::schedule;
  using T = value_type;

  static_assert(router_policy<router_type>,
                "epmoe: the router policy must provide `static constexpr int top_k`, "
                "`static constexpr bool uses_gate` and either an EPMOE_HD route_token(const "
                "token_input&, int* ids, float* weights) const (see router/topk_softmax.hpp) or "
                "route_batch(...) with scratch_floats/scratch_ints (see router/expert_choice.hpp)");
  static_assert(placement_policy<placement_type>,
                "epmoe: the placement policy must be constructible from layer_config and "
                "provide slots_per_rank(), expert_at(rank, j) and an EPMOE_HD slot_for");
  static_assert(capacity_policy<capacity_type>,
                "epmoe: the capacity policy must provide `static constexpr bool pads` and "
                "limit(const layer_config&, index_t tokens) const (see capacity/factor.hpp)");
  static_assert(std::is_same_v<expert_type, expert::swiglu>,
                "epmoe: space::cuda runs expert::swiglu (grouped cuBLAS GEMMs + fused SiLU-mul)");
  static_assert(
      !requires { requires Policies::dedup; },
      "epmoe: per-rank dedup runs on space::host for now; drop `dedup` for space::cuda");
  static_assert(schedule_policy<schedule_type>,
                "epmoe: the schedule policy must provide static run(stages&) (see "
                "schedule/sequential.hpp)");

  using exchange_type = typename cuda_detail::device_exchange_for<comm_type>::type;
  /// Padded capacity on a comm that exchanges counts on the device: fixed shapes, no host
  /// synchronisation, capturable in a CUDA graph.
  /// (A batch router routes on the host, which waits for the logits: not static.)
  static constexpr bool static_mode =
      capacity_type::pads && exchange_type::device_counts && !batch_router<router_type>;

  /// Device pointers; they must outlive the layer.
  struct weights {
    matrix_view<const T> gate;               // [E, H]
    expert::swiglu::weights_of<T> experts;   // this rank's slots, slot order
    expert::swiglu::weights_of<T> shared{};  // [N] shared experts
    matrix_view<const T> noise_gate{};       // [E, H] noisy top-k's projection
  };

  moe_layer(const layer_config& cfg, comm_type comm, const weights& w, router_type router = {},
            capacity_type capacity = {})
      : moe_layer(cfg, std::move(comm), w, router, capacity, placement_type(cfg)) {}

  moe_layer(const layer_config& cfg, comm_type comm, const weights& w, router_type router,
            capacity_type capacity, placement_type placement, space_type space = {})
      : cfg_(agreed(cfg, comm, w, router, placement)),
        comm_(std::move(comm)),
        w_(w),
        router_(router),
        capacity_(capacity),
        placement_(std::move(placement)),
        where_(placement_),
        stats_(cfg_.experts, placement_.slots_per_rank(), cfg_.ranks),
        width_(router_type::top_k > 0 ? router_type::top_k : cfg_.experts) {
    stream_ = space.stream;
    if constexpr (requires { comm_.stream(); })
      if (!stream_) stream_ = comm_.stream();
    if (!stream_) {
      EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&owned_stream_, cudaStreamNonBlocking));
      stream_ = owned_stream_;
    }
    EPMOE_CUDA_CHECK(cublasCreate(&blas_));
    EPMOE_CUDA_CHECK(cublasSetStream(blas_, stream_));
    allocate_workspace();
    // cuBLAS's workspace is ours, so a captured pass allocates nothing inside the graph.
    EPMOE_CUDA_CHECK(cublasSetWorkspace(blas_, blas_workspace_.data(), blas_workspace_.size()));
    xc_ = exchange_type(&comm_, x_send_.data(), x_expert_.data());
    for (auto& e : events_) EPMOE_CUDA_CHECK(cudaEventCreate(&e));
    adopt_router_bias();  // a bias given with the router starts the device copy
  }

  moe_layer(const moe_layer&) = delete;
  moe_layer& operator=(const moe_layer&) = delete;

  ~moe_layer() {
    for (auto& e : events_)
      if (e) cudaEventDestroy(e);
    if (blas_) cublasDestroy(blas_);
    if (owned_stream_) {
      cudaStreamSynchronize(owned_stream_);
      cudaStreamDestroy(owned_stream_);
    }
  }

  /// y [T, H] = MoE(x [T, H]); x, y and token_ids are device memory. Collective. In dynamic
  /// mode the host waits once per pass for the counts; in static mode it returns at once
  /// (call synchronize() or stats() before reading y on the host).
  void forward(matrix_view<const T> x, matrix_view<T> y,
               std::span<const std::int64_t> token_ids = {}) {
    detail::require(x.rows <= cfg_.max_tokens, "x.rows", x.rows,
                    "tokens per pass must be <= config max_tokens");
    detail::require_shape(x, x.rows, cfg_.hidden, "x");
    detail::require_shape(y, x.rows, cfg_.hidden, "y");
    if constexpr (router_needs_token_ids<router_type>)
      detail::require(token_ids.size() == static_cast<std::size_t>(x.rows), "token_ids",
                      token_ids.size(), "this router hashes token ids: pass one per token");
    else
      detail::require(token_ids.empty() || token_ids.size() == static_cast<std::size_t>(x.rows),
                      "token_ids", token_ids.size(), "must be empty or one id per token");
    if constexpr (router_with_noise_gate<router_type>)
      if (router_.training)
        detail::require_shape(w_.noise_gate, cfg_.experts, cfg_.hidden, "weights.noise_gate");
    x_ = x;
    y_ = y;
    token_ids_ = token_ids;
    tokens_ = x.rows;
    limit_ = std::min<index_t>(capacity_.limit(cfg_, tokens_), std::max<index_t>(tokens_, 1));
    if constexpr (capacity_type::pads) limit_ = capacity_.limit(cfg_, tokens_);
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    EPMOE_CUDA_CHECK(cudaStreamIsCapturing(stream_, &capture));
    timed_ = capture == cudaStreamCaptureStatusNone;
    adopt_router_bias();
    if constexpr (static_mode)
      if (layout_limit_ != limit_) {
        if (!timed_)
          throw config_error("x.rows", std::to_string(tokens_),
                             "a captured static-mode pass needs one eager pass at this token "
                             "count first (it fixes the buffer layout)");
        synchronize();  // the previous layout's uploads read pinned arrays rewritten here
        build_static_layout();
      }
    marks_ = 0;
    mark(-1);
    stage_runner stages{*this};
    schedule_type::run(stages);
    stats_pending_ = true;
    ++pass_;
  }

  /// Waits for the rank's stream.
  void synchronize() const { EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

  const layer_config& config() const { return cfg_; }
  /// The last pass (waits for it): rows per expert and rank, drops, padding, bytes, time.
  const pass_stats& stats() const {
    if (stats_pending_) finish_stats();
    return stats_;
  }
  const placement_type& placement() const { return placement_; }
  const comm_type& comm() const { return comm_; }
  int rank() const { return comm_.rank(); }
  cudaStream_t stream() const { return stream_; }
  router_type& router() { return router_; }
  const router_type& router() const { return router_; }
  std::uint64_t passes() const { return pass_; }

  /// Loads the router's per-expert selection bias [E] (host values; every rank the same).
  void set_router_bias(std::span<const float> b) requires router_with_bias<router_type> {
    detail::require(b.size() == static_cast<std::size_t>(cfg_.experts), "router_bias", b.size(),
                    "must hold one value per expert");
    EPMOE_CUDA_CHECK(cudaMemcpyAsync(bias_.data(), b.data(), sizeof(float) * b.size(),
                                     cudaMemcpyHostToDevice, stream_));
    synchronize();
  }

 private:
  template <class U>
  using buffer = device_buffer<U>;

  // The router reads the device copy of the bias; host values it was pointed at (the
  // constructor's router, router().bias = p) are loaded into it first, never dropped.
  void adopt_router_bias() {
    if constexpr (router_with_bias<router_type>) {
      if (router_.bias == bias_.data()) return;
      if (router_.bias)
        set_router_bias({router_.bias, static_cast<std::size_t>(cfg_.experts)});
      else
        EPMOE_CUDA_CHECK(cudaMemsetAsync(bias_.data(), 0, sizeof(float) * cfg_.experts, stream_));
      router_.bias = bias_.data();
    }
  }

  // The host layer's checks, for device views, then the same collective agreement.
  static void checked(const layer_config& cfg, const comm_type& comm, const weights& w,
                      const router_type& router, const placement_type& placement) {
    check_layer_policies(cfg, comm.size(), router, placement);
    detail::require(cfg.chunks <= 1, "chunks", cfg.chunks,
                    "space::cuda runs one chunk per pass for now (0 or 1)");
    detail::require(cfg.max_recv_rows == 0, "max_recv_rows", cfg.max_recv_rows,
                    "space::cuda does not split exchanges into rounds yet (0: unbounded)");

    if constexpr (router_type::uses_gate)
      detail::require_shape(w.gate, cfg.experts, cfg.hidden, "weights.gate");
    expert::swiglu::validate(w.experts, placement.slots_per_rank(), cfg.hidden, cfg.ffn,
                             "weights.experts");
    if (cfg.shared_experts > 0)
      expert::swiglu::validate(w.shared, cfg.shared_experts, cfg.hidden, cfg.shared_width(),
                               "weights.shared");
  }

  static const layer_config& agreed(const layer_config& cfg, comm_type& comm, const weights& w,
                                    const router_type& router, const placement_type& placement) {
    agree_on_layer<Policies>(cfg, comm, placement,
                             [&] { checked(cfg, comm, w, router, placement); });
    return cfg;
  }

  void allocate_workspace() {
    const index_t Tm = cfg_.max_tokens, K = width_, E = cfg_.experts;
    const index_t R = cfg_.ranks, L = placement_.slots_per_rank(), H = cfg_.hidden;
    const index_t P = R * L, N = Tm * K;
    index_t per_expert = std::min(Tm, capacity_.limit(cfg_, Tm));
    if constexpr (requires { router_type::capacity(cfg_, Tm); })
      per_expert = std::min(per_expert, router_type::capacity(cfg_, Tm));  // expert choice
    const index_t per_expert_buf = capacity_type::pads ? capacity_.limit(cfg_, Tm) : per_expert;
    send_cap_ = capacity_type::pads ? P * per_expert_buf : std::min(N, P * per_expert);
    const index_t from_one =
        capacity_type::pads ? L * per_expert_buf : std::min(Tm * std::min(K, L), L * per_expert);
    recv_cap_ = R * from_one;

    logits_ = buffer<float>(router_type::uses_gate ? Tm * E : 0);
    if constexpr (router_with_noise_gate<router_type>) noise_logits_ = buffer<float>(Tm * E);
    if constexpr (router_with_jitter<router_type>) gate_input_ = buffer<T>(Tm * H);
    if constexpr (batch_router<router_type>) {
      host_logits_ = pinned_buffer<float>(Tm * E);
      host_ids_ = pinned_buffer<std::int32_t>(N);
      host_weights_ = pinned_buffer<float>(N);
      batch_floats_.resize(static_cast<std::size_t>(router_type::scratch_floats(cfg_)));
      batch_ints_.resize(static_cast<std::size_t>(router_type::scratch_ints(cfg_)));
    }
    if constexpr (router_type::uses_gate && has_probabilities<router_type>) {
      loss_logits_.resize(static_cast<std::size_t>(Tm * E));
      loss_ids_.resize(static_cast<std::size_t>(N));
      loss_weights_.resize(static_cast<std::size_t>(N));
      loss_probs_.resize(static_cast<std::size_t>(Tm * E));
      loss_acc_.resize(static_cast<std::size_t>(2 * E));
    }
    if constexpr (router_with_bias<router_type>) {
      bias_ = buffer<float>(E);
      EPMOE_CUDA_CHECK(cudaMemsetAsync(bias_.data(), 0, sizeof(float) * E, stream_));
    }
    ids_ = buffer<std::int32_t>(N);
    weights_ = buffer<float>(N);
    slot_ = buffer<std::int32_t>(N);
    keys_ = buffer<int>(2 * N);
    order_ = buffer<int>(2 * N);
    ints_ = buffer<int>(3 * (P + 1) + E);  // slot rows, first of slot, kept | send offsets, routed
    send_offset_ = buffer<int>(P + 1);
    row_token_ = buffer<std::int32_t>(send_cap_);
    msg_ = buffer<index_t>(2 * 3 * P);                   // counts out [R][3L], counts in [R][3L]
    h_msg_ = pinned_buffer<index_t>(2 * 3 * P + 2 * P);  // + remote offsets out / in
    h_summary_ = pinned_buffer<int>(P + E);              // rows per slot, routed per expert
    x_send_ = buffer<T>(send_cap_ * H);
    x_expert_ = buffer<T>(recv_cap_ * H);
    h13_ = buffer<T>(2 * std::max(recv_cap_ * cfg_.ffn, Tm * cfg_.shared_width()));
    if (cfg_.shared_experts > 0) shared_out_ = buffer<float>(Tm * H);
    blocks_.resize(static_cast<std::size_t>(2 * P));
    expert_rows_.assign(static_cast<std::size_t>(L), 0);
    gemm_up_ = cuda_detail::grouped_gemm(static_cast<int>(2 * L));
    gemm_down_ = cuda_detail::grouped_gemm(static_cast<int>(L));
    problems_.resize(static_cast<std::size_t>(2 * L));

    // CUB temporary storage, sized once for the largest pass.
    std::size_t sort_bytes = 0, scan_bytes = 0;
    EPMOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, keys_.data(),
                                                     keys_.data() + N, order_.data(),
                                                     order_.data() + N, static_cast<int>(N)));
    EPMOE_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, ints_.data(), ints_.data(),
                                                   static_cast<int>(P + 1)));
    cub_temp_ = buffer<char>(static_cast<index_t>(std::max(sort_bytes, scan_bytes)) + 1);
    cub_bytes_ = cub_temp_.size();
    blas_workspace_ = buffer<char>(32 << 20);  // NVIDIA's recommendation for Hopper
  }

  // The stages a schedule drives (sequential order; one chunk).
  struct stage_runner {
    moe_layer& l;
    int chunks() const { return 1; }
    void route() { l.do_route(); }
    void plan() { l.do_plan(); }
    void permute() { l.do_permute(); }
    void shared() { l.do_shared(); }
    void counts() { l.do_counts(); }
    void dispatch_start(int) { l.do_dispatch(); }
    void dispatch_wait(int) {}
    void experts(int) { l.do_experts(); }
    void combine_start(int) { l.do_combine(); }
    void combine_wait(int) {}
    void reduce() { l.do_reduce(); }
  };

  int P() const { return cfg_.ranks * placement_.slots_per_rank(); }
  int L() const { return placement_.slots_per_rank(); }

  void do_route() {
    const index_t Tn = tokens_, E = cfg_.experts, K = width_, H = cfg_.hidden;
    const std::int64_t first = std::int64_t{rank()} * cfg_.max_tokens;
    const std::int64_t* tid = token_ids_.empty() ? nullptr : token_ids_.data();
    matrix_view<const float> logits{logits_.data(), router_type::uses_gate ? Tn : 0, E};
    matrix_view<const float> noise{};
    if (Tn > 0) {
      if constexpr (router_type::uses_gate) {
        matrix_view<const T> in = x_;
        if constexpr (router_with_jitter<router_type>)
          if (router_.training) {
            space_type::for_each(Tn * H,
                                 cuda_detail::jitter_input<router_type, T>{
                                     router_, x_, gate_input_.data(), tid, first, pass_},
                                 stream_);
            in = {gate_input_.data(), Tn, H};
          }
        cuda_detail::gemm_nt(blas_, dtype<T>::cuda, in.data, in.stride, w_.gate.data,
                             w_.gate.stride, CUDA_R_32F, logits_.data(), E, Tn, E, H, 0.f);
        if constexpr (router_with_noise_gate<router_type>)
          if (router_.training) {
            cuda_detail::gemm_nt(blas_, dtype<T>::cuda, in.data, in.stride, w_.noise_gate.data,
                                 w_.noise_gate.stride, CUDA_R_32F, noise_logits_.data(), E, Tn, E,
                                 H, 0.f);
            noise = {noise_logits_.data(), Tn, E};
          }
      }
      if constexpr (token_router<router_type>) {
        space_type::for_each(Tn,
                             rows::route_tokens<router_type>{router_,
                                                             logits,
                                                             noise,
                                                             {ids_.data(), Tn, K},
                                                             {weights_.data(), Tn, K},
                                                             tid,
                                                             first,
                                                             pass_,
                                                             static_cast<int>(E)},
                             stream_);
      } else {
        // A batch router decides over the whole batch, on the host (one sync).
        EPMOE_CUDA_CHECK(cudaMemcpyAsync(host_logits_.data(), logits_.data(),
                                         sizeof(float) * Tn * E, cudaMemcpyDeviceToHost, stream_));
        synchronize();
        router_.route_batch(cfg_, {host_logits_.data(), Tn, E},
                            {{host_ids_.data(), Tn, K}, {host_weights_.data(), Tn, K}},
                            std::span<float>(batch_floats_), std::span<std::int32_t>(batch_ints_));
        EPMOE_CUDA_CHECK(cudaMemcpyAsync(ids_.data(), host_ids_.data(),
                                         sizeof(std::int32_t) * Tn * K, cudaMemcpyHostToDevice,
                                         stream_));
        EPMOE_CUDA_CHECK(cudaMemcpyAsync(weights_.data(), host_weights_.data(),
                                         sizeof(float) * Tn * K, cudaMemcpyHostToDevice, stream_));
      }
    }
    mark(stage::route);
  }

  void do_plan() {
    const int Pn = P(), E = cfg_.experts, K = width_;
    const index_t n = tokens_ * K;
    int* slot_rows = ints_.data();
    int* first = slot_rows + (Pn + 1);
    int* kept = first + (Pn + 1);
    int* routed = kept + (Pn + 1);
    EPMOE_CUDA_CHECK(cudaMemsetAsync(slot_rows, 0, sizeof(int) * (Pn + 1), stream_));
    EPMOE_CUDA_CHECK(cudaMemsetAsync(routed, 0, sizeof(int) * E, stream_));
    EPMOE_CUDA_CHECK(
        cudaMemsetAsync(row_token_.data(), 0xff, sizeof(std::int32_t) * send_cap_, stream_));
    const index_t N = cfg_.max_tokens * K;
    if (n > 0) {
      const token_origin origin{rank(), token_ids_.empty() ? nullptr : token_ids_.data(),
                                std::int64_t{rank()} * cfg_.max_tokens};
      cuda_kernels::
          plan_keys<<<cuda_kernels::grid_for(n), cuda_kernels::block_threads, 0, stream_>>>(
              ids_.data(), n, K, where_.view, origin, Pn, keys_.data(), order_.data(), slot_rows,
              routed);
      EPMOE_CUDA_CHECK(cudaGetLastError());
      std::size_t bytes = static_cast<std::size_t>(cub_bytes_);
      int end_bit = 1;
      while ((1 << end_bit) <= Pn) ++end_bit;  // keys are in [0, P]
      EPMOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
          cub_temp_.data(), bytes, keys_.data(), keys_.data() + N, order_.data(), order_.data() + N,
          static_cast<int>(n), 0, end_bit, stream_));
    }
    cuda_kernels::
        slot_sizes<<<cuda_kernels::grid_for(Pn + 1), cuda_kernels::block_threads, 0, stream_>>>(
            slot_rows, Pn, limit_, capacity_type::pads, kept);
    EPMOE_CUDA_CHECK(cudaGetLastError());
    std::size_t bytes = static_cast<std::size_t>(cub_bytes_);
    EPMOE_CUDA_CHECK(
        cub::DeviceScan::ExclusiveSum(cub_temp_.data(), bytes, slot_rows, first, Pn + 1, stream_));
    bytes = static_cast<std::size_t>(cub_bytes_);
    EPMOE_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(cub_temp_.data(), bytes, kept,
                                                   send_offset_.data(), Pn + 1, stream_));
    if (n > 0) {
      cuda_kernels::
          plan_rows<<<cuda_kernels::grid_for(n), cuda_kernels::block_threads, 0, stream_>>>(
              keys_.data() + N, order_.data() + N, n, K, Pn, first, send_offset_.data(), limit_,
              slot_.data(), row_token_.data());
      EPMOE_CUDA_CHECK(cudaGetLastError());
    }
    cuda_kernels::
        count_message<<<cuda_kernels::grid_for(Pn), cuda_kernels::block_threads, 0, stream_>>>(
            kept, slot_rows, send_offset_.data(), cfg_.ranks, L(), limit_, msg_.data());
    EPMOE_CUDA_CHECK(cudaGetLastError());
    // What the host needs to know of the plan: one copy, read after the counts' sync.
    EPMOE_CUDA_CHECK(cudaMemcpyAsync(h_summary_.data(), slot_rows, sizeof(int) * Pn,
                                     cudaMemcpyDeviceToHost, stream_));
    EPMOE_CUDA_CHECK(cudaMemcpyAsync(h_summary_.data() + Pn, routed, sizeof(int) * E,
                                     cudaMemcpyDeviceToHost, stream_));
    EPMOE_CUDA_CHECK(cudaMemcpyAsync(h_msg_.data(), msg_.data(), sizeof(index_t) * 3 * Pn,
                                     cudaMemcpyDeviceToHost, stream_));
    mark(stage::plan);
  }

  // Counts of the pass: dynamic mode learns every size here (one sync); static mode only
  // sends the real-row counts along for stats().
  void do_counts() {
    const int Pn = P(), R = cfg_.ranks, Ln = L(), me = rank();
    index_t* out = h_msg_.data();
    index_t* in = out + 3 * Pn;
    xc_.counts(msg_.data(), msg_.data() + 3 * Pn, out, in, 3 * Ln, stream_);
    if constexpr (!static_mode) {
      synchronize();
      // Expert-major layout of what arrives: slot j's rows from every source, source order.
      index_t at = 0;
      for (int j = 0; j < Ln; ++j) {
        expert_rows_[j] = 0;
        for (int s = 0; s < R; ++s) {
          const index_t rows = in[s * 3 * Ln + j];
          recv_block(s, j) = {s, at, in[s * 3 * Ln + 2 * Ln + j], rows};
          at += rows;
          expert_rows_[j] += rows;
        }
      }
      recv_rows_ = at;
      if (recv_rows_ > recv_cap_)
        throw comm_error("epmoe: rank " + std::to_string(me) + " would receive " +
                         std::to_string(recv_rows_) + " rows, more than its workspace (" +
                         std::to_string(recv_cap_) +
                         "); a peer passed more tokens than max_tokens?");
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < Ln; ++j)
          send_block(r, j) = {r, out[r * 3 * Ln + 2 * Ln + j], 0, out[r * 3 * Ln + j]};
      if constexpr (exchange_type::needs_remote) {
        // Pulls need each block's place in the peer's buffer: tell every source where its
        // rows sit in this rank's expert-major buffer.
        index_t* ro = in + 3 * Pn;
        index_t* ri = ro + Pn;
        for (int s = 0; s < R; ++s)
          for (int j = 0; j < Ln; ++j) ro[s * Ln + j] = recv_block(s, j).local;
        xc_.host_alltoall(ro, ri, Ln);
        for (int r = 0; r < R; ++r)
          for (int j = 0; j < Ln; ++j) send_block(r, j).remote = ri[r * Ln + j];
      }
      send_rows_ = 0;
      for (int b = 0; b < Pn; ++b) send_rows_ += blocks_[b].rows;
      set_expert_problems();
    }
    mark(stage::counts);
  }

  // Static mode: every block holds `limit` rows at a fixed place on both sides.
  void build_static_layout() {
    const int R = cfg_.ranks, Ln = L(), me = rank();
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < Ln; ++j) {
        send_block(r, j) = {r, (r * Ln + j) * limit_, (j * R + me) * limit_, limit_};
        recv_block(r, j) = {r, (j * R + r) * limit_, (me * Ln + j) * limit_, limit_};
      }
    for (int j = 0; j < Ln; ++j) expert_rows_[j] = R * limit_;
    recv_rows_ = send_rows_ = R * Ln * limit_;
    layout_limit_ = limit_;
    set_expert_problems();
  }

  // The grouped GEMM problems of this layout (pointer arrays uploaded on the stream).
  void set_expert_problems() {
    const int Ln = L();
    const index_t H = cfg_.hidden, F = cfg_.ffn;
    T* h1 = h13_.data();
    T* h3 = h1 + recv_cap_ * F;
    const auto& w = w_.experts;
    index_t at = 0;
    for (int j = 0; j < Ln; ++j) {
      const index_t m = expert_rows_[j];
      T* xj = x_expert_.data() + at * H;
      problems_[2 * j] = {xj, H, w.w1.data + j * w.w1.batch_stride, w.w1.stride, h1 + at * F, F, m,
                          F,  H};
      problems_[2 * j + 1] = {
          xj, H, w.w3.data + j * w.w3.batch_stride, w.w3.stride, h3 + at * F, F, m, F, H};
      at += m;
    }
    gemm_up_.set(problems_.data(), 2 * Ln, stream_);
    at = 0;
    for (int j = 0; j < Ln; ++j) {
      const index_t m = expert_rows_[j];
      problems_[j] = {h1 + at * F,
                      F,
                      w.w2.data + j * w.w2.batch_stride,
                      w.w2.stride,
                      x_expert_.data() + at * H,
                      H,
                      m,
                      H,
                      F};
      at += m;
    }
    gemm_down_.set(problems_.data(), Ln, stream_);
  }

  void do_permute() {
    // Dynamic mode permutes after the counts (the send total is known there).
    if constexpr (static_mode) {
      permute_rows();
      mark(stage::permute);
    }
  }

  void permute_rows() {
    const index_t H = cfg_.hidden, rows = send_rows_;
    if (rows == 0) return;
    if (cuda_kernels::vector_width<T>(x_.data, H, x_.stride) > 1 &&
        reinterpret_cast<std::uintptr_t>(x_send_.data()) % 16 == 0) {
      const index_t u = H * sizeof(T) / 16;
      cuda_kernels::gather_rows<<<cuda_kernels::grid_for(rows * u), cuda_kernels::block_threads, 0,
                                  stream_>>>(
          reinterpret_cast<const uint4*>(x_.data), x_.stride * static_cast<index_t>(sizeof(T)) / 16,
          row_token_.data(), rows, u, reinterpret_cast<uint4*>(x_send_.data()));
    } else {
      cuda_kernels::gather_rows<<<cuda_kernels::grid_for(rows * H), cuda_kernels::block_threads, 0,
                                  stream_>>>(x_.data, x_.stride, row_token_.data(), rows, H,
                                             x_send_.data());
    }
    EPMOE_CUDA_CHECK(cudaGetLastError());
  }

  // Shared experts: every token on its home rank, summed in fp32 for the reduce.
  void do_shared() {
    const index_t Nsh = cfg_.shared_experts, Tn = tokens_, H = cfg_.hidden;
    const index_t Fs = cfg_.shared_width();
    stats_.shared_flops = 0;
    if (Nsh == 0 || Tn == 0) return;
    T* h1 = h13_.data();
    T* h3 = h1 + Tn * Fs;
    const auto& w = w_.shared;
    for (index_t s = 0; s < Nsh; ++s) {
      cuda_detail::gemm_nt(blas_, dtype<T>::cuda, x_.data, x_.stride,
                           w.w1.data + s * w.w1.batch_stride, w.w1.stride, dtype<T>::cuda, h1, Fs,
                           Tn, Fs, H, 0.f);
      cuda_detail::gemm_nt(blas_, dtype<T>::cuda, x_.data, x_.stride,
                           w.w3.data + s * w.w3.batch_stride, w.w3.stride, dtype<T>::cuda, h3, Fs,
                           Tn, Fs, H, 0.f);
      silu_mul(h1, h3, Tn * Fs);
      cuda_detail::gemm_nt(blas_, dtype<T>::cuda, h1, Fs, w.w2.data + s * w.w2.batch_stride,
                           w.w2.stride, CUDA_R_32F, shared_out_.data(), H, Tn, H, Fs,
                           s == 0 ? 0.f : 1.f);
    }
    stats_.shared_flops = double(Nsh * Tn) * expert::swiglu::flops_per_row(H, Fs);
    mark(stage::shared);
  }

  void silu_mul(T* a, const T* b, index_t n) {
    constexpr int V = 16 / sizeof(T);
    if (n % V == 0 && reinterpret_cast<std::uintptr_t>(a) % 16 == 0 &&
        reinterpret_cast<std::uintptr_t>(b) % 16 == 0)
      cuda_kernels::silu_mul<T, V>
          <<<cuda_kernels::grid_for(n / V), cuda_kernels::block_threads, 0, stream_>>>(a, b, n);
    else
      cuda_kernels::silu_mul<T, 1>
          <<<cuda_kernels::grid_for(n), cuda_kernels::block_threads, 0, stream_>>>(a, b, n);
    EPMOE_CUDA_CHECK(cudaGetLastError());
  }

  void do_dispatch() {
    if constexpr (!static_mode) {
      permute_rows();
      mark(stage::permute);
    }
    const int Pn = P();
    xc_.exchange(cuda_detail::exchange_source::send, x_send_.data(), blocks_.data(), Pn,
                 x_expert_.data(), blocks_.data() + Pn, Pn, cfg_.hidden, stream_);
    mark(stage::dispatch);
  }

  // Every local expert at once: up projections (W1, W3) as one grouped GEMM, the gate,
  // then the down projection (W2) as one grouped GEMM writing over the expert's input rows.
  void do_experts() {
    if (recv_rows_ > 0) {
      gemm_up_.run(blas_, dtype<T>::cuda, dtype<T>::cuda, 0.f);
      silu_mul(h13_.data(), h13_.data() + recv_cap_ * cfg_.ffn, recv_rows_ * cfg_.ffn);
      gemm_down_.run(blas_, dtype<T>::cuda, dtype<T>::cuda, 0.f);
    }
    mark(stage::experts);
  }

  void do_combine() {
    const int Pn = P();
    // The reverse: blocks received from s go back to s, into its send buffer.
    xc_.exchange(cuda_detail::exchange_source::expert, x_expert_.data(), blocks_.data() + Pn, Pn,
                 x_send_.data(), blocks_.data(), Pn, cfg_.hidden, stream_);
    mark(stage::combine);
  }

  void do_reduce() {
    const index_t Tn = tokens_, H = cfg_.hidden;
    if (Tn > 0) {
      const float* shared = cfg_.shared_experts > 0 ? shared_out_.data() : nullptr;
      constexpr int V = 16 / sizeof(T);
      const bool vec =
          H % V == 0 && y_.stride % V == 0 && reinterpret_cast<std::uintptr_t>(y_.data) % 16 == 0;
      if (vec)
        cuda_kernels::combine_rows<T, V>
            <<<cuda_kernels::grid_for(Tn * H / V), cuda_kernels::block_threads, 0, stream_>>>(
                x_send_.data(), H, slot_.data(), weights_.data(), width_, shared, y_.data,
                y_.stride, Tn);
      else
        cuda_kernels::combine_rows<T, 1>
            <<<cuda_kernels::grid_for(Tn * H), cuda_kernels::block_threads, 0, stream_>>>(
                x_send_.data(), H, slot_.data(), weights_.data(), width_, shared, y_.data,
                y_.stride, Tn);
      EPMOE_CUDA_CHECK(cudaGetLastError());
    }
    mark(stage::reduce);
  }

  // Stage ends, in pass order: an event each (not while a graph is being captured).
  enum class stage : int {
    route,
    plan,
    permute,
    shared,
    counts,
    dispatch,
    experts,
    combine,
    reduce
  };
  static constexpr int max_marks = 10;
  void mark(stage s) { mark(static_cast<int>(s)); }
  void mark(int s) {
    if (!timed_) return;
    mark_stage_[marks_] = s;
    EPMOE_CUDA_CHECK(cudaEventRecord(events_[marks_++], stream_));
  }

  // Fills stats from the pinned copies of the last pass (waits for it).
  void finish_stats() const {
    synchronize();
    stats_pending_ = false;
    const int Pn = P(), R = cfg_.ranks, Ln = L(), E = cfg_.experts, me = rank();
    const index_t H = cfg_.hidden;
    const index_t* out = h_msg_.data();
    const index_t* in = out + 3 * Pn;
    pass_stats& s = stats_;
    s.tokens = tokens_;
    s.assignments = 0;
    s.dropped = 0;
    s.padding_rows = 0;
    for (int p = 0; p < Pn; ++p) {
      const index_t n = h_summary_[p], kept = std::min(n, limit_);
      s.assignments += n;
      s.dropped += n - kept;
      if (capacity_type::pads) s.padding_rows += limit_ - kept;
    }
    for (int e = 0; e < E; ++e) s.routed_per_expert[e] = h_summary_[Pn + e];
    s.expert_imbalance = imbalance::of(s.routed_per_expert);
    index_t sent = 0, received = 0, padded_total = 0;
    for (int r = 0; r < R; ++r) {
      s.rows_sent[r] = s.rows_received[r] = 0;
      for (int j = 0; j < Ln; ++j) {
        s.rows_sent[r] += out[r * 3 * Ln + j];
        s.rows_received[r] += in[r * 3 * Ln + j];
        if (static_mode && in[r * 3 * Ln + j] != limit_)
          throw comm_error("epmoe: static mode: rank " + std::to_string(r) +
                           " padded its blocks to " + std::to_string(in[r * 3 * Ln + j]) +
                           " rows, this rank to " + std::to_string(limit_) +
                           ": every rank must pass the same tokens");
      }
      s.assignment_rows_sent[r] = s.rows_sent[r];
      s.assignment_rows_received[r] = s.rows_received[r];
      if (r != me) {
        sent += s.rows_sent[r];
        received += s.rows_received[r];
      }
    }
    const index_t row_bytes = H * static_cast<index_t>(sizeof(T));
    s.dispatch_bytes_sent = s.combine_bytes_received = sent * row_bytes;
    s.dispatch_bytes_received = s.combine_bytes_sent = received * row_bytes;
    s.rank_imbalance = imbalance::of(s.rows_sent);
    for (int j = 0; j < Ln; ++j) {
      index_t real = 0, padded = 0;
      for (int r = 0; r < R; ++r) {
        real += in[r * 3 * Ln + Ln + j];
        padded += in[r * 3 * Ln + j];
      }
      s.rows_per_local_expert[j] = real;
      s.padded_rows_per_local_expert[j] = padded;
      padded_total += padded;
    }
    s.expert_flops = double(padded_total) * expert::swiglu::flops_per_row(H, cfg_.ffn);
    s.losses = {};
    if constexpr (router_type::uses_gate && has_probabilities<router_type>) {
      // Losses from this pass's logits and routing (still in the workspace), on the host.
      const index_t Tn = tokens_, K = width_;
      EPMOE_CUDA_CHECK(cudaMemcpy(loss_logits_.data(), logits_.data(), sizeof(float) * Tn * E,
                                  cudaMemcpyDeviceToHost));
      EPMOE_CUDA_CHECK(cudaMemcpy(loss_ids_.data(), ids_.data(), sizeof(std::int32_t) * Tn * K,
                                  cudaMemcpyDeviceToHost));
      EPMOE_CUDA_CHECK(cudaMemcpy(loss_weights_.data(), weights_.data(), sizeof(float) * Tn * K,
                                  cudaMemcpyDeviceToHost));
      compute_losses(router_, cfg_, {loss_logits_.data(), Tn, E},
                     {{loss_ids_.data(), Tn, K}, {loss_weights_.data(), Tn, K}},
                     std::span<float>(loss_probs_), std::span<double>(loss_acc_), s.losses);
    }
    s.chunks = 1;
    s.timeline.clear();
    s.time = {};
    s.comm_seconds = s.exposed_comm_seconds = s.overlap = 0;
    if (timed_ && marks_ > 1) {
      const auto since_start = [&](int i) {
        float ms = 0;
        EPMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[0], events_[i]));
        return ms * 1e-3;
      };
      double* field[] = {&s.time.route,   &s.time.plan,    &s.time.permute,
                         &s.time.shared,  &s.time.plan,    &s.time.dispatch,
                         &s.time.experts, &s.time.combine, &s.time.reduce};
      for (int i = 1; i < marks_; ++i) {
        const double a = since_start(i - 1), b = since_start(i);
        *field[mark_stage_[i]] += b - a;
        const int st = mark_stage_[i];
        if (st == int(stage::dispatch)) s.timeline.push_back({0, stage_kind::dispatch, a, b});
        if (st == int(stage::experts)) s.timeline.push_back({0, stage_kind::experts, a, b});
        if (st == int(stage::combine)) s.timeline.push_back({0, stage_kind::combine, a, b});
      }
      s.time.total = since_start(marks_ - 1);
      // One stream: every exchange is exposed (the pipelined overlap is a host-space feature).
      s.comm_seconds = s.exposed_comm_seconds = s.time.dispatch + s.time.combine;
    }
  }

  cuda_detail::row_block& send_block(int r, int j) { return blocks_[r * L() + j]; }
  cuda_detail::row_block& recv_block(int s, int j) { return blocks_[P() + s * L() + j]; }

  layer_config cfg_;
  comm_type comm_;
  weights w_;
  router_type router_;
  capacity_type capacity_;
  placement_type placement_;
  cuda_detail::device_placement<placement_type> where_;
  mutable pass_stats stats_;
  int width_;  // routing slots per token: top_k, or E for expert choice
  mutable bool stats_pending_ = false;

  cudaStream_t stream_ = nullptr, owned_stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  cudaEvent_t events_[max_marks] = {};
  int mark_stage_[max_marks] = {};
  int marks_ = 0;
  bool timed_ = true;
  exchange_type xc_;

  buffer<float> logits_, noise_logits_, weights_, bias_, shared_out_;
  buffer<T> gate_input_;
  pinned_buffer<float> host_logits_, host_weights_;  // batch routers: routing on the host
  pinned_buffer<std::int32_t> host_ids_;
  std::vector<float> batch_floats_;
  std::vector<std::int32_t> batch_ints_;
  mutable std::vector<float> loss_logits_, loss_weights_, loss_probs_;  // losses in stats()
  mutable std::vector<std::int32_t> loss_ids_;
  mutable std::vector<double> loss_acc_;
  buffer<std::int32_t> ids_, slot_, row_token_;
  buffer<int> keys_, order_, ints_, send_offset_;
  buffer<index_t> msg_;
  buffer<char> cub_temp_, blas_workspace_;
  index_t cub_bytes_ = 0;
  buffer<T> x_send_, x_expert_, h13_;
  pinned_buffer<index_t> h_msg_;
  pinned_buffer<int> h_summary_;
  std::vector<cuda_detail::row_block> blocks_;  // [P] sends, then [P] receives
  std::vector<index_t> expert_rows_;            // [L] rows each local expert computes
  std::vector<cuda_detail::gemm_problem> problems_;
  cuda_detail::grouped_gemm gemm_up_, gemm_down_;

  index_t send_cap_ = 0, recv_cap_ = 0, send_rows_ = 0, recv_rows_ = 0;
  index_t limit_ = 0, layout_limit_ = -1;
  matrix_view<const T> x_;
  matrix_view<T> y_;
  std::span<const std::int64_t> token_ids_;
  index_t tokens_ = 0;
  std::uint64_t pass_ = 0;
};

}  // namespace epmoe
