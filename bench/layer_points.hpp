// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// One benchmark point: the layer forward at T tokens on one rank, side by side in the same
// process with (a) one BLAS GEMM of the same expert FLOPs and (b) the layer's own expert GEMM
// calls alone (same shapes, inputs already gathered), repetition by repetition.
#pragma once

#include "bench_common.hpp"
#include <epmoe/reference/weights.hpp>

namespace bench {

struct point_options {
  rep_policy reps;
  int batches = 4;    // distinct token batches, cycled (routing differs pass to pass)
  bool flush = true;  // evict the caches before every timed call (weights come from memory)
  bool pack = true;   // the layer packs its expert weights (moe_layer::pack_weights); --no-pack
  bool bf16 = false;  // --bf16: packed as bf16 (half the bytes)
  std::FILE* out = stdout;
};

/// The flags every layer benchmark takes: --shapes, --tokens, --min-reps N, --max-reps N,
/// --min-seconds S, --batches N, --no-flush, --no-pack, --bf16, --no-layer, --quick-machine,
/// --json FILE|-.
struct layer_bench_options {
  std::string shapes;
  std::vector<index_t> tokens;
  point_options point;
  bool layer = true;  // --no-layer: only the machine
  bool quick_machine = false;
  std::string json_path;

  /// True if the current argument was one of these flags (its value read).
  bool flag(cli::command_line& cl) {
    if (cl.is("--shapes"))
      shapes = cl.value();
    else if (cl.is("--tokens"))
      tokens = token_list(cl);
    else if (cl.is("--min-reps"))
      point.reps.min_reps = static_cast<int>(cl.integer());
    else if (cl.is("--max-reps"))
      point.reps.max_reps = static_cast<int>(cl.integer());
    else if (cl.is("--min-seconds"))
      point.reps.min_seconds = cl.number();
    else if (cl.is("--batches"))
      point.batches = std::max(1, static_cast<int>(cl.integer()));
    else if (cl.is("--no-flush"))
      point.flush = false;
    else if (cl.is("--no-pack"))
      point.pack = false;
    else if (cl.is("--bf16"))
      point.bf16 = true;
    else if (cl.is("--no-layer"))
      layer = false;
    else if (cl.is("--quick-machine"))
      quick_machine = true;
    else if (cl.is("--json"))
      json_path = cl.value();
    else
      return false;
    return true;
  }
};

/// Reads a buffer larger than the last-level cache, so the next call finds its weights in
/// memory, as a layer does in a model whose other layers ran in between.
class cache_flusher {
 public:
  explicit cache_flusher(bool on) : a_(on ? std::size_t{96} << 18 : 0, 1.f) {}
  void operator()() {
    float s = 0;
    for (std::size_t i = 0; i < a_.size(); i += 16) s += a_[i];  // one read per 64-byte line
    sink_ = sink_ + s;
  }

 private:
  std::vector<float> a_;
  volatile float sink_ = 0;
};

/// Random weights of a one-rank layer (cfg.ranks = 1) as it takes them: the experts the
/// placement puts on rank 0 (local-slot order), the gate and the shared experts.
template <class Layer>
struct rank0_weights {
  epmoe::reference::full_weights full;
  epmoe::reference::rank_weights mine;

  explicit rank0_weights(const layer_config& cfg)
      : full(epmoe::reference::full_weights::random(cfg, 1)),
        mine(epmoe::reference::slice(full, typename Layer::placement_type(cfg), 0)) {
    std::vector<float>().swap(full.w1);  // the layer reads the slice; free the second copy
    std::vector<float>().swap(full.w3);
    std::vector<float>().swap(full.w2);
  }
  typename Layer::weights views() const {
    return {full.gate_view(), mine.experts(), full.shared()};
  }
};

/// C[M,N] = A[M,K] B[N,K]^T as one BLAS call (the portable loop when there is no BLAS).
inline void one_gemm(const float* a, const float* b, float* c, index_t M, index_t N, index_t K) {
#if defined(EPMOE_HAS_CBLAS)
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(M), static_cast<int>(N),
              static_cast<int>(K), 1.f, a, static_cast<int>(K), b, static_cast<int>(K), 0.f, c,
              static_cast<int>(N));
#else
  epmoe::space::host_gemm_nt({a, M, K}, {b, N, K}, {c, M, N});
#endif
}

/// The layer of shape s at every T of `tokens` on one rank; one JSON object per point.
template <class P, class Router>
std::vector<json> layer_points(const shape& s, Router router, const std::vector<index_t>& tokens,
                               const point_options& o, const machine& m) {
  using layer_t = epmoe::moe_layer<P>;
  layer_config cfg = s.cfg;
  cfg.ranks = 1;
  cfg.max_tokens = static_cast<int>(*std::max_element(tokens.begin(), tokens.end()));
  const index_t H = cfg.hidden, F = cfg.ffn, Fs = cfg.shared_width(), N = cfg.shared_experts;

  const rank0_weights<layer_t> w(cfg);
  const auto experts = w.mine.experts();
  const auto shared = w.full.shared();
  layer_t layer(cfg, epmoe::comm::local{}, w.views(), router);
  // The GEMMs alone run on the layer's kernels: over packed copies of the same weights when
  // the layer packs.
  epmoe::space::host space{};
  epmoe::space::packed_weights packed;
  const bool bf16 = o.pack && o.bf16;
  const auto as = bf16 ? epmoe::packed_precision::bf16 : epmoe::packed_precision::fp32;
  if (o.pack) {
    layer.pack_weights(as);
    for (auto v : {experts.w1, experts.w3, experts.w2}) packed.pack(v, as);
    if (N > 0)
      for (auto v : {shared.w1, shared.w3, shared.w2}) packed.pack(v, as);
    space.use_packed(&packed);
  }
  const bool dot = bf16 && space.kernel_path() == epmoe::space::cpu_path::avx512_bf16;
  const std::string kernel =
      !o.pack ? "sgemm/stream"
      : dot   ? "packed bf16 AVX512-BF16 dot"
              : std::string(bf16 ? "packed bf16 (widened) " : "packed ") +
                  epmoe::space::name_of(space.kernel_path() == epmoe::space::cpu_path::avx512_bf16
                                            ? epmoe::space::cpu_path::avx512
                                            : space.kernel_path());
  cache_flusher flush(o.flush);
  using v8 = float __attribute__((vector_size(32)));
  std::vector<v8> probe;
  epmoe::space::detail::stream_helpers readers;
  volatile float sink = 0;

  const double weight_size = bf16 ? 2.0 : 4.0;  // bytes per expert weight the layer reads
  const double expert_bytes = 3.0 * H * F * weight_size;
  const double shared_bytes = 3.0 * N * H * Fs * weight_size;
  const double gate_bytes = double(cfg.experts) * H * sizeof(float);

  std::vector<json> points;
  for (index_t T : tokens) {
    const int B = o.batches;
    std::vector<std::vector<float>> xs;
    for (int b = 0; b < B; ++b) xs.push_back(epmoe::reference::random_tokens(T, H, 100 + b));
    std::vector<float> y(T * H);
    const auto run_layer = [&](int b) { layer.forward({xs[b].data(), T, H}, {y.data(), T, H}); };

    // One pass per batch: the rows each expert gets, to replay its GEMMs alone.
    std::vector<std::vector<index_t>> rows(B);
    std::vector<double> flops(B), active(B);
    index_t most = T;  // rows of the largest batch: routed, then T for the shared experts
    for (int b = 0; b < B; ++b) {
      run_layer(b);
      const auto& st = layer.stats();
      rows[b] = st.padded_rows_per_local_expert;
      flops[b] = st.expert_flops + st.shared_flops;
      index_t total = N > 0 ? T : 0;
      for (index_t n : rows[b]) {
        active[b] += n > 0;
        total += n;
      }
      most = std::max(most, total);
    }
    double mean_flops = 0, mean_active = 0;
    for (int b = 0; b < B; ++b) {
      mean_flops += flops[b] / B;
      mean_active += active[b] / B;
    }
    // As in the layer, each expert reads its own block of gathered rows and the scratch is
    // shared; the outputs go to their own rows (not over the inputs, which later passes reuse).
    const index_t Fmax = std::max(F, Fs);
    std::vector<float> gin(most * H, 0.01f), g1(most * Fmax), g3(most * Fmax), gout(most * H);
    const auto gemms_alone = [&](int b) {
      index_t at = 0;
      // One group per call, as the layer's grouped GEMMs see an expert.
      const auto expert_gemms = [&](const epmoe::expert::swiglu::weights& w, index_t j, index_t n) {
        const index_t f = w.w1.rows, rows[2] = {0, n};
        const auto one = [&](float* d, index_t c) {
          return epmoe::grouped_rows<float>{d, c, c, 1, rows, rows};
        };
        const auto ew = epmoe::expert::swiglu::slice(w, j, 1);
        space.grouped_gemm_nt(one(gin.data() + at * H, H), ew.w1, one(g1.data(), f));
        space.grouped_gemm_nt(one(gin.data() + at * H, H), ew.w3, one(g3.data(), f));
        space.grouped_gemm_nt(one(g1.data(), f), ew.w2, one(gout.data() + at * H, H));
        at += n;
      };
      for (index_t j = 0; j < static_cast<index_t>(rows[b].size()); ++j)
        if (rows[b][j] > 0) expert_gemms(experts, j, rows[b][j]);
      const index_t routed = at;
      for (index_t n = 0; n < N; ++n) {
        at = routed;  // every shared expert reads the same T rows
        expert_gemms(shared, n, T);
      }
    };

    // One GEMM doing the same FLOPs: [M, H] x [H, 3F], M = expert rows (routed + shared);
    // with bf16 copies, one GEMM over bf16 panels on the layer's kernel (its own best rate).
    const index_t M = std::max<index_t>(1, std::llround(mean_flops / (6.0 * H * F)));
    std::vector<float> ra(M * H, 0.01f), rb(3 * F * H, 0.01f), rc(M * 3 * F);
    epmoe::space::host one_space{};
    epmoe::space::packed_weights one_packed;
    const epmoe::stacked_view<const float> rbv(rb.data(), 1, 3 * F, H);
    const index_t one_rows[2] = {0, M};
    if (bf16) {
      one_packed.pack(rbv, as);
      one_packed.reserve_inputs(M, one_space.kernel_path());
      one_space.use_packed(&one_packed);
    }
    const auto one_big_gemm = [&] {
      if (!bf16) return one_gemm(ra.data(), rb.data(), rc.data(), M, 3 * F, H);
      one_space.grouped_gemm_nt({ra.data(), H, H, 1, one_rows, one_rows}, rbv,
                                {rc.data(), 3 * F, 3 * F, 1, one_rows, one_rows});
    };

    // Reading the activated weights' bytes once (a buffer of that size, all cores), timed
    // beside the layer: the memory side of the roofline, from the same minutes of the run.
    const double weight_bytes = mean_active * expert_bytes + shared_bytes + gate_bytes;
    const std::size_t probe_n = static_cast<std::size_t>(weight_bytes / sizeof(v8));
    if (probe.size() < probe_n) probe.assign(probe_n, v8{} + 1.f);
    const auto read_weights_bytes = [&] {
      const int chunks = 8 * m.cpus;
      v8 sums[64] = {};
      const auto part = [&](int c) {
        const std::size_t b = probe_n * c / chunks, e = probe_n * (c + 1) / chunks;
        v8 s0{}, s1{}, s2{}, s3{};
        for (std::size_t i = b; i + 4 <= e; i += 4)
          s0 += probe[i], s1 += probe[i + 1], s2 += probe[i + 2], s3 += probe[i + 3];
        sums[c % 64] += s0 + s1 + s2 + s3;
      };
      if (!readers.run(m.cpus, chunks, part))
        for (int c = 0; c < chunks; ++c) part(c);
      sink = sink + sums[0][0];
    };

    std::vector<double> t_layer, t_alone, t_gemm, t_read;
    std::vector<epmoe::stage_times> stages;
    const auto timed = [&](std::vector<double>* into, const auto& f) {
      if (o.flush) flush();
      const auto start = clock::now();
      f();
      if (into) into->push_back(seconds_since(start));
    };
    const int reps = repeat(o.reps, [&](int i) {
      const int b = (i + B) % B;
      const bool keep = i >= 0;
      timed(keep ? &t_gemm : nullptr, one_big_gemm);
      timed(keep ? &t_alone : nullptr, [&] { gemms_alone((b + 2) % B); });
      timed(keep ? &t_layer : nullptr, [&] { run_layer(b); });
      timed(keep ? &t_read : nullptr, read_weights_bytes);
      if (keep) stages.push_back(layer.stats().time);
    });

    const double layer_s = median(t_layer), alone_s = median(t_alone), gemm_s = median(t_gemm);
    // The faster of the side-by-side read and the machine's best read rate at the start.
    const double read_s = std::min(median(t_read), weight_bytes / (m.read_gbs() * 1e9));
    const double weight_gbs = weight_bytes / layer_s * 1e-9;
    // The roofline bound: reading the activated weights once (timed beside the layer), or the
    // expert FLOPs at one large sgemm's rate (the machine's, or the side-by-side one GEMM of
    // these FLOPs when it ran faster: with bf16 copies, the bf16 one), whichever is longer.
    const double gemm_rate = std::max(m.sgemm_gflops * 1e9, mean_flops / gemm_s);
    const double bound_s = std::max(read_s, mean_flops / gemm_rate);
    json p = json::object();
    p.add("shape", s.name)
        .add("tokens", static_cast<long long>(T))
        .add("reps", reps)
        .add("layer_ms", layer_s * 1e3)
        .add("stage_ms", stage_json(stages))
        .add("expert_gflop", mean_flops * 1e-9)
        .add("expert_gflops", mean_flops / layer_s * 1e-9)
        .add("one_gemm_m", static_cast<long long>(M))
        .add("one_gemm_ms", gemm_s * 1e3)
        .add("efficiency", gemm_s / layer_s)
        .add("gemms_alone_ms", alone_s * 1e3)
        .add("overhead", layer_s / alone_s)
        .add("active_experts", mean_active)
        .add("weight_mb", weight_bytes * 1e-6)
        .add("weight_gbs", weight_gbs)
        .add("weight_bw_fraction", read_s / layer_s)  // of the side-by-side read
        .add("read_weights_ms", read_s * 1e3)
        .add("roofline_ms", bound_s * 1e3)
        .add("roofline_fraction", bound_s / layer_s)
        .add("kernel", kernel);
    std::fprintf(
        o.out, "%-14s %5lld %9.3f %9.3f %9.3f %7.1f %6.2f %6.2f %7.1f %5.0f%% %5.0f%%  %s  [%s]\n",
        s.name.c_str(), static_cast<long long>(T), layer_s * 1e3, gemm_s * 1e3, alone_s * 1e3,
        mean_flops / layer_s * 1e-9, gemm_s / layer_s, layer_s / alone_s, weight_gbs,
        100 * read_s / layer_s, 100 * bound_s / layer_s, kernel.c_str(),
        stage_text(stages).c_str());
    std::fflush(o.out);
    points.push_back(p);
  }
  return points;
}

}  // namespace bench
