// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// The layer's training step on one rank: forward (config training: it keeps what backward
// needs) and backward timed separately, repetition by repetition, with the expert FLOPs each
// runs and the backward's stage times. Prints a table and the goal of issue 20 (backward
// within 2.3x the forward at T >= 1024), met or missed; --json writes every figure.
//
//   epmoe_bench_train [--shapes mixtral,deepseek|tiny|NAME,...] [--tokens 128,1024,4096]
//                     [--recompute] [--min-reps N] [--max-reps N] [--min-seconds S]
//                     [--batches N] [--no-flush] [--no-layer] [--quick-machine] [--json FILE|-]
//
// Columns: fwd ms and bwd ms (medians), bwd/fwd (their ratio), step ms (median of fwd + bwd
// per repetition); GFLOP: the expert GEMMs of each pass (routed rows, padding included, and
// the shared experts), GFLOP/s: those over the pass's time; then the backward's stages.
#include "layer_points.hpp"

namespace {

using namespace bench;

// The routed experts' backward FLOPs are the layer's own count (stats().expert_flops after
// backward): expert::glu::backward runs dh = dy W2, dW1, dW3, dW2 and dx = da W1 + db W3, 6
// GEMMs the size of the forward's 3, and with --recompute (config recompute) the two
// up-projections again, 8. The shared experts always recompute: 8/3 of their forward's.
constexpr double shared_backward_per_forward = 8.0 / 3.0;

// Issue 20's goal: backward / forward <= 2.3 at T >= 1024.
constexpr double goal_ratio = 2.3;
constexpr index_t goal_tokens = 1024;

constexpr const char* usage_text =
    "usage: epmoe_bench_train [--shapes all|tiny|NAME,...] [--tokens 128,1024,4096]\n"
    "  [--recompute] [--min-reps N] [--max-reps N] [--min-seconds S] [--batches N]\n"
    "  [--no-flush] [--no-layer] [--quick-machine] [--json FILE|-]\n"
    "  The layer's forward (training mode) and backward on one rank, timed separately:\n"
    "  backward / forward and the backward's stages (bench/README.md). --recompute: the\n"
    "  experts' hidden layers recomputed in backward instead of kept (config recompute).\n";

bool recompute = false;  // --recompute

layer_bench_options parse(int argc, char** argv) {
  layer_bench_options o;
  o.shapes = "mixtral,deepseek";
  o.tokens = {128, 1024, 4096};
  cli::command_line cl(argc, argv, usage_text);
  while (cl.next())
    if (cl.is("--recompute"))
      recompute = true;
    else if (!o.flag(cl))
      cl.unknown();
  return o;
}

/// The gradients of a one-rank layer, owned, and their views (shaped as the weights).
struct grad_arrays {
  layer_config c;
  std::vector<float> gate, w1, w3, w2, s1, s3, s2;
  explicit grad_arrays(const layer_config& cfg)
      : c(cfg),
        gate(c.experts * c.hidden),
        w1(c.experts * c.ffn * c.hidden),
        w3(w1.size()),
        w2(w1.size()),
        s1(c.shared_experts * c.shared_width() * c.hidden),
        s3(s1.size()),
        s2(s1.size()) {}
  template <class Layer>
  typename Layer::gradients views() {
    const index_t E = c.experts, H = c.hidden, F = c.ffn, N = c.shared_experts,
                  Fs = c.shared_width();
    return {{gate.data(), E, H},
            {{w1.data(), E, F, H}, {w3.data(), E, F, H}, {w2.data(), E, H, F}},
            {{s1.data(), N, Fs, H}, {s3.data(), N, Fs, H}, {s2.data(), N, H, Fs}}};
  }
};

/// The layer of shape s at every T on one rank, in training mode; one JSON object per point.
template <class P, class Router>
std::vector<json> train_points(const shape& s, Router router, const layer_bench_options& o,
                               std::FILE* out, std::vector<std::string>& goals) {
  using layer_t = epmoe::moe_layer<P>;
  layer_config cfg = s.cfg;
  cfg.ranks = 1;
  cfg.max_tokens = static_cast<int>(*std::max_element(o.tokens.begin(), o.tokens.end()));
  cfg.training = true;
  cfg.recompute = recompute;
  const index_t H = cfg.hidden;
  const rank0_weights<layer_t> w(cfg);
  layer_t layer(cfg, epmoe::comm::local{}, w.views(), router);
  grad_arrays g(cfg);
  const auto grads = g.views<layer_t>();
  cache_flusher flush(o.point.flush);
  // Each pass finds its weights in memory, as between a model's other layers.
  const auto timed = [&](const auto& f) {
    if (o.point.flush) flush();
    const auto start = clock::now();
    f();
    return seconds_since(start);
  };

  std::vector<json> points;
  for (index_t T : o.tokens) {
    const int B = o.point.batches;  // cycled: routing differs pass to pass
    std::vector<std::vector<float>> xs, dys;
    for (int b = 0; b < B; ++b) {
      xs.push_back(epmoe::reference::random_tokens(T, H, 100 + b));
      dys.push_back(epmoe::reference::random_tokens(T, H, 200 + b));
    }
    std::vector<float> y(T * H), dx(T * H);
    std::vector<double> t_fwd, t_bwd, t_step, flops, back_flops;
    std::vector<epmoe::stage_times> fwd_stages, bwd_stages;
    const int reps = repeat(o.point.reps, [&](int i) {
      const int b = (i + B) % B;
      const double f = timed([&] { layer.forward({xs[b].data(), T, H}, {y.data(), T, H}); });
      const epmoe::pass_stats fs = layer.stats();
      const double d = timed([&] {
        layer.backward({dys[b].data(), T, H}, {dx.data(), T, H}, grads);
      });
      if (i < 0) return;  // the warm-up
      t_fwd.push_back(f);
      t_bwd.push_back(d);
      t_step.push_back(f + d);
      flops.push_back(fs.expert_flops + fs.shared_flops);
      back_flops.push_back(layer.stats().expert_flops +
                           fs.shared_flops * shared_backward_per_forward);
      fwd_stages.push_back(fs.time);
      bwd_stages.push_back(layer.stats().time);
    });

    double fwd_flops = 0, bwd_flops = 0;
    for (double v : flops) fwd_flops += v / static_cast<double>(flops.size());
    for (double v : back_flops) bwd_flops += v / static_cast<double>(back_flops.size());
    const double fwd_s = median(t_fwd), bwd_s = median(t_bwd), ratio = bwd_s / fwd_s;
    json p = json::object();
    p.add("shape", s.name)
        .add("tokens", static_cast<long long>(T))
        .add("reps", reps)
        .add("forward_ms", fwd_s * 1e3)
        .add("backward_ms", bwd_s * 1e3)
        .add("backward_over_forward", ratio)
        .add("step_ms", median(t_step) * 1e3)
        .add("forward_expert_gflop", fwd_flops * 1e-9)
        .add("backward_expert_gflop", bwd_flops * 1e-9)
        .add("forward_gflops", fwd_flops / fwd_s * 1e-9)
        .add("backward_gflops", bwd_flops / bwd_s * 1e-9)
        .add("forward_stage_ms", stage_json(fwd_stages))
        .add("backward_stage_ms", stage_json(bwd_stages));
    if (T >= goal_tokens) {
      p.add("goal", json::object()
                        .add("backward_over_forward_max", goal_ratio)
                        .add("met", ratio <= goal_ratio));
      char line[128];
      std::snprintf(line, sizeof line, "  %s %-14s T=%-5lld bwd/fwd %.2f (<= %.1f)\n",
                    ratio <= goal_ratio ? "met   " : "MISSED", s.name.c_str(),
                    static_cast<long long>(T), ratio, goal_ratio);
      goals.push_back(line);
    }
    std::fprintf(out, "%-14s %5lld %9.3f %9.3f %7.2f %9.3f %9.2f %9.2f %8.1f %8.1f  [bwd: %s]\n",
                 s.name.c_str(), static_cast<long long>(T), fwd_s * 1e3, bwd_s * 1e3, ratio,
                 median(t_step) * 1e3, fwd_flops * 1e-9, bwd_flops * 1e-9, fwd_flops / fwd_s * 1e-9,
                 bwd_flops / bwd_s * 1e-9, stage_text(bwd_stages).c_str());
    std::fflush(out);
    points.push_back(p);
  }
  return points;
}

}  // namespace

int main(int argc, char** argv) {
  const layer_bench_options o = parse(argc, argv);
  // With the JSON on stdout, the tables go to stderr.
  std::FILE* out = o.json_path == "-" ? stderr : stdout;

  // The read bandwidth is not compared with here: not measured.
  const machine m = machine::measure(o.quick_machine, 0, false);
  m.print(out);
  json root = json::object();
  root.add("program", "epmoe_bench_train").add("machine", m.to_json());
  root.add("flush_caches", o.point.flush).add("batches", o.point.batches);
  root.add("recompute", recompute);

  if (o.layer) {
    std::fprintf(out, "%-14s %5s %9s %9s %7s %9s %9s %9s %8s %8s\n", "shape", "T", "fwd ms",
                 "bwd ms", "bwd/fwd", "step ms", "fwd GFLOP", "bwd GFLOP", "fwd GF/s", "bwd GF/s");
    json points = json::array();
    std::vector<std::string> goals;
    for (const shape& s : parse_shapes(o.shapes))
      with_policies<epmoe::comm::local, false>(s, [&]<class P>(auto router) {
        for (const json& p : train_points<P>(s, router, o, out, goals)) points.push(p);
      });
    root.add("points", points);
    // A missed goal is a finding, not a failure: the exit status stays 0.
    if (!goals.empty())
      std::fprintf(out,
                   "\ngoal (issue 20): backward / forward <= %.1f at T >= %lld; the routed "
                   "experts' backward GEMMs are %s the forward's\n",
                   goal_ratio, static_cast<long long>(goal_tokens),
                   recompute ? "8/3 (recompute)" : "2x (hidden layers kept)");
    for (const std::string& line : goals) std::fputs(line.c_str(), out);
  }
  if (!o.json_path.empty()) write_text(o.json_path, root.str());
  return 0;
}
