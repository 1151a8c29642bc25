// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// A decode loop of a tiny MoE model's MoE layers, with and without two-batch overlap.
//   mpiexec -n 2 build/default/examples/epmoe_decode            (2 MPI processes)
//   build/default/examples/epmoe_decode --threads 4              (4 thread ranks, no mpiexec)
// Each step runs two micro-batches of T tokens per rank through L layers; a layer is a fixed
// cost stand-in for attention (a wait, as a GPU's attention kernel leaves the host idle),
// then the MoE layer. Plain: per layer, A's attention and MoE pass (a blocking forward), then
// B's. Two-batch overlap: per layer, A's attention, start(A), B's attention while A's
// dispatch is on the wire, start(B), experts(A) while B's dispatch is on the wire, experts(B)
// while A's combine is, finish(A), finish(B).
// The link is comm::throttled, its latency calibrated to the experts' time at each T (the
// regime where overlap pays), 25 GB/s; attention takes that time too. Prints tokens/s, the
// step times side by side and the MoE stage times per pass; exits 1 when the two schedules'
// outputs differ (they are bit-identical: options.deterministic).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "args.hpp"
#include <epmoe/comm/throttled.hpp>
#include <epmoe/epmoe.hpp>
#include <epmoe/reference/weights.hpp>
#include <epmoe/split_layer.hpp>
#ifdef EPMOE_DECODE_MPI
#include <epmoe/comm/mpi.hpp>
#endif

using namespace epmoe;
using clock_type = std::chrono::steady_clock;

namespace {

template <class Inner, int K, bool LowLatency>
struct policies : default_policies {
  using router = epmoe::router::topk_softmax<K>;
  using comm = epmoe::comm::throttled<Inner>;
  static constexpr layer_options options{.deterministic = true, .low_latency = LowLatency};
};

struct options {
  std::string shape = "mixtral";
  bool low_latency = false;  // the fixed-slot exchange: start posts its one round
  std::vector<long long> tokens{1, 4, 16, 64};
  int layers = 4, steps = 10;
};

// Scaled-down shapes: Mixtral (8 experts, top-2, FFN 3.5 H) and DeepSeek (64 fine-grained
// experts, top-8, FFN H / 4); H 512 so that a CPU runs a step in milliseconds.
layer_config shape_of(const std::string& s, int ranks, int max_tokens) {
  if (s == "deepseek")
    return {.hidden = 512, .ffn = 128, .experts = 64, .top_k = 8, .ranks = ranks,
            .max_tokens = max_tokens};
  return {.hidden = 512, .ffn = 1792, .experts = 8, .top_k = 2, .ranks = ranks,
          .max_tokens = max_tokens};
}

double seconds_since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

// The largest of every rank's value (one all-to-all of the inner comm).
template <class Comm>
double max_over_ranks(Comm& c, double v) {
  std::vector<double> send(static_cast<std::size_t>(c.size()), v), recv(send.size());
  c.alltoall(send.data(), recv.data(), 1);
  return *std::max_element(recv.begin(), recv.end());
}

struct row {
  int T = 0;
  double link_us = 0, plain_ms = 0, overlap_ms = 0, dispatch_ms = 0, experts_ms = 0,
         combine_ms = 0;
  bool same = true;
};

// One rank's decode loop at every T; rank 0's rows are the report. make() makes this rank's
// inner comm (a lane each, and one for the calibration).
template <class Inner, int K, bool LowLatency, class Make>
std::vector<row> run_rank(Make&& make, int me, int R, const options& o) {
  using P = policies<Inner, K, LowLatency>;
  const int Tmax = static_cast<int>(*std::max_element(o.tokens.begin(), o.tokens.end()));
  const layer_config cfg = shape_of(o.shape, R, Tmax);
  const auto full = reference::full_weights::random(cfg, 1);
  const auto mine = reference::slice(full, placement::block(cfg), me);
  const typename moe_layer<P>::weights w{full.gate_view(), mine.experts()};
  const index_t H = cfg.hidden;
  std::vector<row> rows;
  for (long long TT : o.tokens) {
    const auto T = static_cast<index_t>(TT);
    row r{.T = static_cast<int>(T)};
    // Calibration: the experts' time of a pass at T on an instant link.
    double experts = 0;
    {
      moe_layer<P> probe(cfg, comm::throttled<Inner>(make(), comm::link{1e15, 0}), w);
      const auto x = reference::random_tokens(T, H, 99 + me);  // (a spread routing)
      std::vector<float> y(x.size());
      std::vector<double> t;
      for (int i = 0; i < 7; ++i) {
        probe.forward({x.data(), T, H}, {y.data(), T, H});
        t.push_back(probe.stats().time.experts);
      }
      std::sort(t.begin(), t.end());
      Inner agree = make();
      experts = max_over_ranks(agree, t[t.size() / 2]);
    }
    const comm::link link{.bandwidth = 25e9, .latency = experts};
    const auto attention = std::chrono::duration<double>(experts);
    r.link_us = experts * 1e6;
    std::vector<std::unique_ptr<split_layer<P>>> layers;
    for (int l = 0; l < o.layers; ++l) {
      std::vector<comm::throttled<Inner>> lanes;  // (comm::mpi is move-only)
      lanes.emplace_back(make(), link);
      lanes.emplace_back(make(), link);
      layers.push_back(std::make_unique<split_layer<P>>(cfg, std::move(lanes), w));
    }
    // Micro-batches A and B: x [T, H] each; a layer adds its MoE output (a residual).
    std::vector<std::vector<float>> x0(2), x(2), y(2), last(2);
    for (int m = 0; m < 2; ++m) {
      x0[m] = reference::random_tokens(T, H, 10 * me + m);
      y[m].resize(x0[m].size());
      x[m].resize(x0[m].size());
    }
    const auto residual = [&](int m) {
      for (std::size_t i = 0; i < x[m].size(); ++i) x[m][i] += y[m][i];
    };
    const auto xv = [&](int m) { return matrix_view<const float>{x[m].data(), T, H}; };
    const auto yv = [&](int m) { return matrix_view<float>{y[m].data(), T, H}; };
    for (int overlap = 0; overlap < 2; ++overlap) {
      double total = 0;
      for (int step = -2; step < o.steps; ++step) {  // two warm-up steps
        for (int m = 0; m < 2; ++m) std::copy(x0[m].begin(), x0[m].end(), x[m].begin());
        const auto t0 = clock_type::now();
        for (int l = 0; l < o.layers; ++l) {
          auto& moe = *layers[static_cast<std::size_t>(l)];
          if (!overlap) {
            for (int m = 0; m < 2; ++m) {
              std::this_thread::sleep_for(attention);
              moe.forward(xv(m), yv(m));
              residual(m);
            }
          } else {
            std::this_thread::sleep_for(attention);
            const auto a = moe.start(xv(0), yv(0));
            std::this_thread::sleep_for(attention);  // A's dispatch on the wire
            const auto b = moe.start(xv(1), yv(1));
            moe.experts(a);  // B's dispatch on the wire
            moe.experts(b);  // A's combine on the wire
            moe.finish(a);
            moe.finish(b);
            residual(0), residual(1);
          }
          if (step >= 0 && !overlap) {
            const auto& s = moe.lane(0).stats().time;
            r.dispatch_ms += s.dispatch * 1e3, r.experts_ms += s.experts * 1e3,
                r.combine_ms += s.combine * 1e3;
          }
        }
        if (step >= 0) total += seconds_since(t0);
        if (step == 0 && !overlap) last = x;
        if (step == 0 && overlap) r.same = last == x;
      }
      (overlap ? r.overlap_ms : r.plain_ms) = total / o.steps * 1e3;
    }
    const double passes = static_cast<double>(o.steps) * o.layers;
    r.dispatch_ms /= passes, r.experts_ms /= passes, r.combine_ms /= passes;
    rows.push_back(r);
  }
  return rows;
}

template <class Inner, class Make>
std::vector<row> run_shape(Make&& make, int me, int R, const options& o) {
  if (o.low_latency)
    return o.shape == "deepseek" ? run_rank<Inner, 8, true>(make, me, R, o)
                                 : run_rank<Inner, 2, true>(make, me, R, o);
  return o.shape == "deepseek" ? run_rank<Inner, 8, false>(make, me, R, o)
                               : run_rank<Inner, 2, false>(make, me, R, o);
}

int report(const std::vector<row>& rows, const options& o, int R, const char* comm) {
  std::printf(
      "decode: %s-like, %d layers, %d ranks (%s), %s exchange, 2 micro-batches of T tokens per "
      "rank\n",
      o.shape.c_str(), o.layers, R, comm, o.low_latency ? "low-latency" : "default");
  std::printf("link: comm::throttled, 25 GB/s, latency = the experts' time at T; attention: a "
              "wait of that time\n");
  std::printf("%4s %9s %10s %12s %7s %12s %12s %11s %11s %11s %5s\n", "T", "link us",
              "plain ms", "overlap ms", "ratio", "plain tok/s", "overlap tok/s", "dispatch ms",
              "experts ms", "combine ms", "same");
  bool ok = true;
  for (const row& r : rows) {
    const double tokens = 2.0 * r.T * R;
    std::printf("%4d %9.1f %10.3f %12.3f %7.3f %12.0f %12.0f %11.3f %11.3f %11.3f %5s\n", r.T,
                r.link_us, r.plain_ms, r.overlap_ms, r.overlap_ms / r.plain_ms,
                tokens / (r.plain_ms * 1e-3), tokens / (r.overlap_ms * 1e-3), r.dispatch_ms,
                r.experts_ms, r.combine_ms, r.same ? "yes" : "NO");
    ok = ok && r.same;
  }
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  static const char* usage =
      "usage: epmoe_decode [--threads N] [--shape mixtral|deepseek] [--tokens 1,4,16,64]\n"
      "                    [--layers L] [--steps S] [--low-latency]\n"
      "  A decode loop of L MoE layers (attention a fixed-time stand-in) over MPI processes\n"
      "  (mpiexec -n R) or N thread ranks: per T, the step time of two micro-batches, plain\n"
      "  and with two-batch overlap (split phase), tokens/s and the MoE stage times.\n"
      "  --low-latency: the fixed-slot exchange (one round per direction, no counts round:\n"
      "  start posts the dispatch and returns).\n";
  cli::command_line cl(argc, argv, usage);
  options o;
  int threads = 0;
  while (cl.next()) {
    if (cl.is("--threads"))
      threads = static_cast<int>(cl.integer());
    else if (cl.is("--shape"))
      o.shape = cl.value();
    else if (cl.is("--tokens"))
      o.tokens = cl.integers();
    else if (cl.is("--layers"))
      o.layers = static_cast<int>(cl.integer());
    else if (cl.is("--steps"))
      o.steps = static_cast<int>(cl.integer());
    else if (cl.is("--low-latency"))
      o.low_latency = true;
    else
      cl.unknown();
  }
  if (o.shape != "mixtral" && o.shape != "deepseek") cl.fail("--shape: mixtral or deepseek");
  for (long long t : o.tokens)
    if (t < 1 || t > 4096) cl.fail("--tokens: each in [1, 4096]");
  if (o.layers < 1 || o.steps < 1) cl.fail("--layers and --steps must be >= 1");
#ifdef EPMOE_DECODE_MPI
  if (threads == 0) {
    comm::mpi_session session(argc, argv);
    int R = 1, me = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &R);
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    const auto rows =
        run_shape<comm::mpi>([] { return comm::mpi(MPI_COMM_WORLD); }, me, R, o);
    int bad = 0;
    if (me == 0) bad = report(rows, o, R, "MPI processes");
    MPI_Bcast(&bad, 1, MPI_INT, 0, MPI_COMM_WORLD);
    return bad;
  }
#endif
  const int R = std::max(threads, 1);
  comm::threads_world world(R);
  std::vector<row> rows;
  world.run([&](comm::threads c) {
    auto got = run_shape<comm::threads>([c] { return c; }, c.rank(), R, o);
    if (c.rank() == 0) rows = std::move(got);
  });
  return report(rows, o, R, "thread ranks");
}
