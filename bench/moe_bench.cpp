// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// The layer forward side by side, in one run, with one BLAS GEMM of the same expert FLOPs,
// with its own expert GEMM calls alone, and with the machine's read bandwidth; then the
// expert-parallel scaling over in-process ranks. Prints tables; --json writes every figure.
//
//   epmoe_bench [--shapes all|tiny|mixtral,deepseek,...] [--tokens 1,16,128,1024,4096]
//               [--min-reps N] [--max-reps N] [--min-seconds S] [--batches N] [--no-flush]
//               [--no-pack] [--bf16] [--scaling] [--scaling-tokens 128,1024] [--scaling-reps N]
//               [--no-layer]
//               [--quick-machine] [--read-gbs GB/s] [--json FILE|-]
//
// Columns: layer ms (median); 1-GEMM ms: one [M, H] x [H, 3F] BLAS call of the same expert
// FLOPs (M = expert rows); alone ms: the layer's expert GEMM calls alone; GFLOP/s: expert FLOPs
// / layer time; eff = 1-GEMM / layer; ovh = layer / alone; GB/s: activated experts' weight
// bytes / layer time, and that as % of the measured read bandwidth; roofl: the roofline bound
// max(those bytes / read bandwidth, expert FLOPs / one large sgemm's rate) / layer time;
// kernel: the expert GEMMs' kernel (packed weights and the CPU path, or sgemm/stream with
// --no-pack).
#include <cstring>

#include "layer_points.hpp"
#include "scaling.hpp"

namespace {

using namespace bench;

struct options : layer_bench_options {
  bool scaling = false;
  std::vector<index_t> scaling_tokens = {128, 1024};
  int scaling_reps = 5;
  double read_gbs = 0;
};

constexpr const char* usage_text =
    "usage: epmoe_bench [--shapes all|tiny|NAME,...] [--tokens 1,16,...] [--min-reps N]\n"
    "  [--max-reps N] [--min-seconds S] [--batches N] [--no-flush] [--no-pack] [--bf16]\n"
    "  [--scaling] [--scaling-tokens 128,1024] [--scaling-reps N] [--no-layer] [--quick-machine]\n"
    "  [--read-gbs GB/s] [--json FILE|-]\n"
    "  The layer forward against one BLAS GEMM of its expert FLOPs, its own GEMMs alone and\n"
    "  the read bandwidth; --scaling: 1 vs 2 in-process ranks (bench/README.md).\n";

options parse(int argc, char** argv) {
  options o;
  o.shapes = "all";
  o.tokens = {1, 16, 128, 1024, 4096};
  cli::command_line cl(argc, argv, usage_text);
  while (cl.next()) {
    if (o.flag(cl)) continue;
    if (cl.is("--scaling"))
      o.scaling = true;
    else if (cl.is("--scaling-tokens"))
      o.scaling_tokens = token_list(cl);
    else if (cl.is("--scaling-reps"))
      o.scaling_reps = std::max(1, static_cast<int>(cl.integer()));
    else if (cl.is("--read-gbs"))
      o.read_gbs = cl.number();
    else
      cl.unknown();
  }
  return o;
}

// Threads ranks: 1 and 2 ranks, without and with dedup, at each global token count. Each
// rank's BLAS gets cpus / ranks threads, so every run uses the same cores.
void threads_scaling(const shape& s, const options& o, const machine& m, std::FILE* out,
                     json& arr) {
  auto full = epmoe::reference::full_weights::random(s.cfg, 1);
  // (ranks, BLAS threads per rank): 1 x all, 2 x all / 2 (the same cores), and 1 x all / 2
  // (the same threads per rank: what a second rank adds).
  const int half = std::max(1, m.blas_threads / 2);
  std::vector<std::pair<int, int>> runs_of = {{1, m.blas_threads}, {2, half}};
  if (half != m.blas_threads) runs_of.insert(runs_of.begin() + 1, {1, half});
  for (index_t G : o.scaling_tokens)
    for (const auto& [R, threads] : runs_of)
      for (bool dedup : {false, true}) {
        if (G % R != 0 || s.cfg.experts % R != 0) continue;
        set_blas_threads(threads);
        std::vector<rank_run> runs(static_cast<std::size_t>(R));
        epmoe::comm::threads_world world(R);
        const auto body = [&]<bool D>() {
          world.run([&](epmoe::comm::threads c) {
            with_policies<epmoe::comm::threads, D>(s, [&]<class P>(auto router) {
              runs[c.rank()] = scaling_rank<P>(s, router, c, full, G, o.scaling_reps,
                                               o.point.batches, o.point.pack);
            });
          });
        };
        if (dedup)
          body.template operator()<true>();
        else
          body.template operator()<false>();
        set_blas_threads(m.blas_threads);
        print_scaling_row(out, s, "threads", G, R, dedup, threads, runs);
        arr.push(scaling_json(s, "threads", G, dedup, threads, runs));
      }
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  // With the JSON on stdout, the tables go to stderr.
  std::FILE* out = o.json_path == "-" ? stderr : stdout;
  point_options po = o.point;
  po.out = out;

  const machine m = machine::measure(o.quick_machine, o.read_gbs);
  m.print(out);
  json root = json::object();
  root.add("program", "epmoe_bench").add("machine", m.to_json());
  root.add("flush_caches", po.flush)
      .add("batches", po.batches)
      .add("packed_weights", po.pack)
      .add("packed_bf16", po.pack && po.bf16);

  const auto shapes = parse_shapes(o.shapes);
  if (o.layer) {
    std::fprintf(out, "%-14s %5s %9s %9s %9s %7s %6s %6s %7s %6s %6s  %s\n", "shape", "T",
                 "layer ms", "1-GEMM ms", "alone ms", "GFLOP/s", "eff", "ovh", "GB/s", "of bw",
                 "roofl", "kernel");
    json points = json::array();
    for (const shape& s : shapes)
      with_policies<epmoe::comm::local, false>(s, [&]<class P>(auto router) {
        for (const json& p : layer_points<P>(s, router, o.tokens, po, m)) points.push(p);
      });
    root.add("points", points);
    std::fprintf(out, "\n");
  }
  if (o.scaling) {
    print_scaling_header(out);
    json scaling = json::array();
    for (const shape& s : shapes) threads_scaling(s, o, m, out, scaling);
    root.add("scaling", scaling);
  }
  if (!o.json_path.empty()) write_text(o.json_path, root.str());
  return 0;
}
