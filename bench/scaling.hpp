// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// Expert-parallel scaling: a fixed number of global tokens split over R ranks (threads of
// this process or MPI processes), with and without per-rank dedup. The code one rank runs is
// the same for every comm.
#pragma once

#include "bench_common.hpp"
#include <epmoe/reference/weights.hpp>

namespace bench {

/// What one rank measured: the time of each pass, and the rows it sent to other ranks.
struct rank_run {
  std::vector<double> seconds;       // per timed pass (forward's stats().time.total)
  index_t rows_sent = 0;             // rows that left this rank (dispatch), last pass
  index_t assignment_rows_sent = 0;  // the same without dedup: (token, expert) rows
  index_t dispatch_bytes = 0;        // bytes this rank sent in the dispatch, last pass
  std::vector<epmoe::stage_times> stages;
};

/// One rank's share: tokens [r*G/R, (r+1)*G/R) of each global batch, `reps` timed passes
/// after one warm-up, cycling `batches` batches. Collective over comm.
template <class P, class Router, class Comm>
rank_run scaling_rank(const shape& s, Router router, Comm comm,
                      const epmoe::reference::full_weights& full, index_t global_tokens, int reps,
                      int batches, bool pack = true) {
  using layer_t = epmoe::moe_layer<P>;
  const int R = comm.size(), r = comm.rank();
  layer_config cfg = s.cfg;
  cfg.ranks = R;
  const index_t T = global_tokens / R, H = cfg.hidden;
  cfg.max_tokens = static_cast<int>(T);
  const auto mine = epmoe::reference::slice(full, typename layer_t::placement_type(cfg), r);
  layer_t layer(cfg, std::move(comm), {full.gate_view(), mine.experts(), full.shared()}, router);
  if (pack) layer.pack_weights();

  std::vector<std::vector<float>> xs;
  for (int b = 0; b < batches; ++b) {
    const auto all = epmoe::reference::random_tokens(global_tokens, H, 100 + b);
    xs.emplace_back(all.begin() + r * T * H, all.begin() + (r + 1) * T * H);
  }
  std::vector<float> y(T * H);
  rank_run out;
  for (int i = -1; i < reps; ++i) {
    const int b = (i + batches) % batches;
    layer.forward({xs[b].data(), T, H}, {y.data(), T, H});
    if (i >= 0) {
      out.seconds.push_back(layer.stats().time.total);
      out.stages.push_back(layer.stats().time);
    }
  }
  const auto& st = layer.stats();
  for (int q = 0; q < R; ++q)
    if (q != r) {
      out.rows_sent += st.rows_sent[q];
      out.assignment_rows_sent += st.assignment_rows_sent[q];
    }
  out.dispatch_bytes = st.dispatch_bytes_sent;
  return out;
}

/// Combines the ranks' runs: a pass takes as long as its slowest rank; rows and bytes add up.
inline json scaling_json(const shape& s, const char* comm, index_t global_tokens, bool dedup,
                         int blas_threads, const std::vector<rank_run>& ranks) {
  const int R = static_cast<int>(ranks.size());
  std::vector<double> pass;
  for (std::size_t i = 0; i < ranks[0].seconds.size(); ++i) {
    double slowest = 0;
    for (const rank_run& q : ranks) slowest = std::max(slowest, q.seconds[i]);
    pass.push_back(slowest);
  }
  index_t rows = 0, assignments = 0, bytes = 0;
  for (const rank_run& q : ranks) {
    rows += q.rows_sent;
    assignments += q.assignment_rows_sent;
    bytes += q.dispatch_bytes;
  }
  // Stage times of rank 0 (the other ranks' are alike).
  const json stages = stage_json(ranks[0].stages);
  json j = json::object();
  j.add("shape", s.name)
      .add("comm", comm)
      .add("global_tokens", static_cast<long long>(global_tokens))
      .add("ranks", R)
      .add("dedup", dedup)
      .add("blas_threads_per_rank", blas_threads)
      .add("reps", static_cast<int>(pass.size()))
      .add("ms", median(pass) * 1e3)
      .add("rank0_stage_ms", stages)
      .add("rows_sent_off_rank", static_cast<long long>(rows))
      .add("assignment_rows_sent_off_rank", static_cast<long long>(assignments))
      .add("dispatch_bytes_sent", static_cast<long long>(bytes));
  return j;
}

inline void print_scaling_header(std::FILE* out) {
  std::fprintf(out, "%-14s %-8s %7s %5s %5s %6s %10s %10s %12s\n", "shape", "comm", "tokens",
               "ranks", "dedup", "BLAS/r", "ms", "rows sent", "(no dedup)");
}

inline void print_scaling_row(std::FILE* out, const shape& s, const char* comm, index_t G, int R,
                              bool dedup, int threads, const std::vector<rank_run>& ranks) {
  std::vector<double> pass;
  for (std::size_t i = 0; i < ranks[0].seconds.size(); ++i) {
    double slowest = 0;
    for (const rank_run& q : ranks) slowest = std::max(slowest, q.seconds[i]);
    pass.push_back(slowest);
  }
  index_t rows = 0, assignments = 0;
  for (const rank_run& q : ranks) {
    rows += q.rows_sent;
    assignments += q.assignment_rows_sent;
  }
  std::fprintf(out, "%-14s %-8s %7lld %5d %5s %6d %10.3f %10lld %12lld\n", s.name.c_str(), comm,
               static_cast<long long>(G), R, dedup ? "yes" : "no", threads, median(pass) * 1e3,
               static_cast<long long>(rows), static_cast<long long>(assignments));
  std::fflush(out);
}

}  // namespace bench
