// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// 8-bit dispatch rows (issue 37; layer_config::dispatch_rows) against rows at the activation
// type, side by side in one run: R thread ranks, both benchmark shapes, T tokens per rank, the
// flat exchange. Per row format: the dispatch and combine bytes every rank sent (summed; the
// ratio of the dispatch's to fp32 rows, and to bf16 rows: 2H bytes a row, what a 16-bit space
// sends), and the pass time (the slowest rank's median) over the plain comm and over
// comm::throttled with a link calibrated so the fp32 rows' exchange (dispatch and combine, the
// busiest rank's share) takes `--slow` times the experts' time (default 4: the exchange
// dominates). permute ms: the sender's stage (quantising each token once); dispatch ms: the
// dispatch stage (the receiver dequantises there).
//   epmoe_bench_wire [--shapes all|tiny|NAME,...] [--tokens T] [--ranks R] [--reps N] [--slow X]
#include <algorithm>
#include <cstdio>
#include <vector>

#include "bench_common.hpp"
#include <epmoe/comm/throttled.hpp>
#include <epmoe/reference/weights.hpp>

namespace {

using namespace bench;
using epmoe::pass_stats;
using epmoe::row_format;

struct options {
  std::string shapes = "all";
  index_t tokens = 64;  // per rank
  int ranks = 4;
  int reps = 5;
  double slow = 4;  // the fp32 rows' exchange time over the experts' time
};

/// One rank's figures: medians over the timed passes, bytes of the last one.
struct rank_numbers {
  double ms = 0, comm_ms = 0, experts_ms = 0, permute_ms = 0, dispatch_ms = 0;
  double rows = 0, dispatch_bytes = 0, combine_bytes = 0;
  double link_bytes = 0;  // the larger of what it sent and received, dispatch + combine
};

template <class P, class Router, class Comm>
rank_numbers run_rank(const layer_config& cfg, Router router, Comm comm,
                      const epmoe::reference::full_weights& full, int reps) {
  using layer_t = epmoe::moe_layer<P>;
  const int r = comm.rank();
  const index_t T = cfg.max_tokens, H = cfg.hidden;
  const auto mine = epmoe::reference::slice(full, typename layer_t::placement_type(cfg), r);
  layer_t layer(cfg, std::move(comm), {full.gate_view(), mine.experts(), full.shared()}, router);
  layer.pack_weights();
  const auto all = epmoe::reference::random_tokens(T * cfg.ranks, H, 100);
  const std::vector<float> x(all.begin() + r * T * H, all.begin() + (r + 1) * T * H);
  std::vector<float> y(x.size());
  std::vector<double> ms, comm_ms, experts_ms, permute_ms, dispatch_ms;
  for (int i = -1; i < reps; ++i) {
    layer.forward({x.data(), T, H}, {y.data(), T, H});
    if (i < 0) continue;
    const pass_stats& st = layer.stats();
    ms.push_back(st.time.total * 1e3);
    comm_ms.push_back(st.comm_seconds * 1e3);
    experts_ms.push_back(st.time.experts * 1e3);
    permute_ms.push_back(st.time.permute * 1e3);
    dispatch_ms.push_back(st.time.dispatch * 1e3);
  }
  const pass_stats& st = layer.stats();
  rank_numbers n{median(ms), median(comm_ms), median(experts_ms), median(permute_ms),
                 median(dispatch_ms)};
  for (int q = 0; q < cfg.ranks; ++q)
    if (q != r) n.rows += static_cast<double>(st.rows_sent[static_cast<std::size_t>(q)]);
  n.dispatch_bytes = static_cast<double>(st.dispatch_bytes_sent);
  n.combine_bytes = static_cast<double>(st.combine_bytes_sent);
  n.link_bytes = static_cast<double>(std::max(st.dispatch_bytes_sent, st.dispatch_bytes_received) +
                                     std::max(st.combine_bytes_sent, st.combine_bytes_received));
  return n;
}

/// Every rank's numbers combined: times of the slowest rank, rows and bytes summed.
rank_numbers combine(const std::vector<rank_numbers>& ranks) {
  rank_numbers c;
  for (const rank_numbers& q : ranks) {
    c.ms = std::max(c.ms, q.ms);
    c.comm_ms = std::max(c.comm_ms, q.comm_ms);
    c.experts_ms = std::max(c.experts_ms, q.experts_ms);
    c.permute_ms = std::max(c.permute_ms, q.permute_ms);
    c.dispatch_ms = std::max(c.dispatch_ms, q.dispatch_ms);
    c.link_bytes = std::max(c.link_bytes, q.link_bytes);
    c.rows += q.rows, c.dispatch_bytes += q.dispatch_bytes, c.combine_bytes += q.combine_bytes;
  }
  return c;
}

void print_row(const std::string& shape, const char* link, const char* rows,
               const rank_numbers& n) {
  std::printf("%-14s %-10s %-6s %9.0f %11.3f %10.3f %9.2f %9.2f %9.2f %9.2f\n", shape.c_str(), link,
              rows, n.rows, n.dispatch_bytes * 1e-6, n.combine_bytes * 1e-6, n.permute_ms,
              n.dispatch_ms, n.comm_ms, n.ms);
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  cli::command_line cl(
      argc, argv,
      "usage: epmoe_bench_wire [--shapes all|tiny|NAME,...] [--tokens T] [--ranks R] [--reps N]\n"
      "  [--slow X]\n"
      "  8-bit dispatch rows (int8 + a scale per row) against fp32 rows on R thread ranks\n"
      "  (default 4), T tokens per rank (default 64): the dispatch and combine bytes, their\n"
      "  ratio to fp32 and bf16 rows, and the pass time over the plain comm and over a\n"
      "  throttled link on which the fp32 rows' exchange takes X times the experts' time\n"
      "  (default 4).\n");
  while (cl.next()) {
    if (cl.is("--shapes"))
      o.shapes = cl.value();
    else if (cl.is("--tokens"))
      o.tokens = std::max<index_t>(1, cl.integer());
    else if (cl.is("--ranks"))
      o.ranks = static_cast<int>(cl.integer());
    else if (cl.is("--reps"))
      o.reps = std::max(1, static_cast<int>(cl.integer()));
    else if (cl.is("--slow"))
      o.slow = cl.number();
    else
      cl.unknown();
  }
  if (o.ranks < 1) cl.fail("--ranks must be >= 1");
  if (!(o.slow > 0)) cl.fail("--slow must be > 0");
  const int R = o.ranks;
  using Inner = epmoe::comm::threads;
  using Slow = epmoe::comm::throttled<Inner>;
  const auto each_rank = [&](auto fn) {
    std::vector<rank_numbers> all(static_cast<std::size_t>(R));
    epmoe::comm::threads_world world(R);
    world.run([&](Inner c) { all[static_cast<std::size_t>(c.rank())] = fn(c); });
    return combine(all);
  };
  set_blas_threads(1);  // ranks share the cores
  std::printf(
      "8-bit dispatch rows: %d ranks (in-process threads), %lld tokens per rank; CPU: %s; GEMM: "
      "%s\nrows and MB: sent to other ranks, summed over ranks; ms: the slowest rank's median\n\n",
      R, static_cast<long long>(o.tokens), cpu_model().c_str(), epmoe::space::host_gemm_backend());
  std::printf("%-14s %-10s %-6s %9s %11s %10s %9s %9s %9s %9s\n", "shape", "link", "rows",
              "rows sent", "dispatch MB", "combine MB", "permute", "dispatch", "comm ms",
              "layer ms");
  for (const shape& s : parse_shapes(o.shapes)) {
    layer_config cfg = s.cfg;
    cfg.ranks = R;
    cfg.max_tokens = static_cast<int>(o.tokens);
    if (cfg.experts % R != 0) continue;
    const auto full = epmoe::reference::full_weights::random(cfg, 1);
    layer_config wire = cfg;
    wire.dispatch_rows = row_format::int8;
    rank_numbers plain[2], slow[2];  // [fp32 rows, int8 rows]
    with_policies<Inner, false>(s, [&]<class P>(auto router) {
      for (int q = 0; q < 2; ++q)
        plain[q] = each_rank(
            [&](Inner c) { return run_rank<P>(q ? wire : cfg, router, c, full, o.reps); });
    });
    // The link moves the fp32 rows' busiest share (dispatch and combine) in `slow` times the
    // experts' time.
    const double bw =
        std::max(plain[0].link_bytes, 1.0) / (o.slow * std::max(plain[0].experts_ms, 1e-3) * 1e-3);
    const epmoe::comm::link link{.bandwidth = bw, .latency = 20e-6};
    with_policies<Slow, false>(s, [&]<class P>(auto router) {
      for (int q = 0; q < 2; ++q)
        slow[q] = each_rank([&](Inner c) {
          return run_rank<P>(q ? wire : cfg, router, Slow(c, link), full, o.reps);
        });
    });
    print_row(s.name, "plain", "fp32", plain[0]);
    print_row(s.name, "plain", "int8", plain[1]);
    print_row(s.name, "throttled", "fp32", slow[0]);
    print_row(s.name, "throttled", "int8", slow[1]);
    std::printf(
        "%-14s int8 rows: dispatch bytes %.3f of fp32 rows, %.3f of bf16 rows ((H + 4) / 4H, "
        "(H + 4) / 2H); exchange bytes (both) %.3f; layer time %.2f plain, %.2f throttled "
        "(%.0f MB/s link)\n\n",
        s.name.c_str(), plain[1].dispatch_bytes / std::max(plain[0].dispatch_bytes, 1.0),
        plain[1].dispatch_bytes / std::max(plain[0].dispatch_bytes / 2, 1.0),
        (plain[1].dispatch_bytes + plain[1].combine_bytes) /
            std::max(plain[0].dispatch_bytes + plain[0].combine_bytes, 1.0),
        plain[1].ms / plain[0].ms, slow[1].ms / slow[0].ms, bw * 1e-6);
    std::fflush(stdout);
  }
  return 0;
}
