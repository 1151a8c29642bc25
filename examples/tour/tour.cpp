// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// epmoe tour: the eight facts of expert parallelism, each shown by a measurement on the real
// layer (tour.hpp holds the experiments; this file prints them).
//
//   epmoe_tour [--step N] [--json FILE] [--small] [--ranks R] [--help]
//
// Ranks are threads of this process (R = 4 by default); under mpiexec, when built with MPI,
// they are the MPI processes (mpiexec -n 4 epmoe_tour). R must divide the 8 experts.
#include "tour.hpp"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

using namespace epmoe;
using namespace epmoe::tour;

namespace {

// --- printing ------------------------------------------------------------------------------

void row(const char* label, const std::vector<double>& v, const char* fmt = " %8.0f") {
  std::printf("  %-28s", label);
  for (double x : v) std::printf(fmt, x);
  std::printf("\n");
}

void header(const char* label, int n, const char* name) {
  std::printf("  %-28s", label);
  for (int i = 0; i < n; ++i) std::printf(" %7s%d", name, i);
  std::printf("\n");
}

/// The load check of a timed step: what it saw, and whether to trust the times.
void print(const machine_load& m) {
  const std::string busy = busy_because(m);
  std::printf(
      "  load check: a fixed kernel took %.2f ms before and %.2f ms after, at %.0f%% of a core; "
      "median pass %.2fx the fastest: %s\n",
      m.calibration_ms_before, m.calibration_ms_after, 100 * m.core_share, 1 + m.pass_spread,
      busy.empty() ? "quiet" : "busy, rerun");
}

void print(const distribution_result& r) {
  for (int s = 0; s < r.ranks; ++s) {
    std::printf("  rank %d holds experts", s);
    for (int e : r.experts_of_rank[s]) std::printf(" e%d", e);
    std::printf("  (%.2f MB)\n", r.bytes_per_rank[s] / 1e6);
  }
  std::printf("  every expert on every rank:  %.2f MB per rank\n", r.replicated_bytes / 1e6);
}

void print(const exchanges_result& r) {
  std::printf("  per pass and rank, seen by a counting communicator (%d passes):\n", r.passes);
  std::printf("    alltoall  (row counts): %d exchange, %.0f B\n", r.counts_exchanges_per_pass,
              r.counts_bytes);
  std::printf("    alltoallv (token rows): %d exchanges, rows of %.0f B\n",
              r.row_exchanges_per_pass, r.row_bytes);
  const int R = static_cast<int>(r.dispatch_bytes.size());
  header("bytes to other ranks", R, "rank");
  row("#1 dispatch (comm)", r.dispatch_bytes);
  row("#1 dispatch (stats)", r.stats_dispatch_bytes);
  row("#2 combine  (comm)", r.combine_bytes);
  row("#2 combine  (stats)", r.stats_combine_bytes);
}

void print(const compute_result& r) {
  std::printf("  %-26s %14s %24s\n", "", "MFLOP/token", "experts ms (all ranks)");
  std::printf("  %-26s %14.2f %24.2f\n", format("top-%d of %d (the MoE)", r.k, r.experts).c_str(),
              r.flops_per_token_topk / 1e6, r.expert_seconds_topk * 1e3);
  std::printf("  %-26s %14.2f %24.2f\n", format("all %d experts (dense)", r.experts).c_str(),
              r.flops_per_token_dense / 1e6, r.expert_seconds_dense * 1e3);
  std::printf("  FLOP ratio %.4f, K/E = %.4f, time ratio %.2f\n", r.flop_ratio,
              double(r.k) / r.experts, r.time_ratio);
  print(r.load);
}

void print(const routing_result& r) {
  const int E = static_cast<int>(r.expert_rows_uniform.size());
  const int R = static_cast<int>(r.rank_rows_uniform.size());
  header("rows per expert", E, "e");
  row("uniform tokens", r.expert_rows_uniform);
  row("skewed tokens", r.expert_rows_skewed);
  header("rows per rank", R, "rank");
  row("uniform tokens", r.rank_rows_uniform);
  row("skewed tokens", r.rank_rows_skewed);
  std::printf("  max/mean: experts %.2f -> %.2f, ranks %.2f -> %.2f\n",
              r.expert_max_over_mean_uniform, r.expert_max_over_mean_skewed,
              r.rank_max_over_mean_uniform, r.rank_max_over_mean_skewed);
}

void print(const capacity_result& r) {
  std::printf("  %-16s %9s %12s %13s %12s %14s\n", "capacity factor", "capacity", "buffer rows",
              "drop uniform", "drop skewed", "shapes fixed");
  for (const capacity_row& c : r.padded)
    std::printf("  %-16.2f %9.0f %12.0f %12.1f%% %11.1f%% %14s\n", c.factor, c.capacity,
                c.buffer_rows, 100 * c.drop_uniform, 100 * c.drop_skewed,
                c.shapes_fixed ? "yes" : "no");
  std::printf("  %-16s %9s %12s %12.1f%% %11.1f%% %14s\n", "dropless", "-",
              format("%.0f / %.0f", r.dropless_busiest_rows[0], r.dropless_busiest_rows[1]).c_str(),
              100 * r.dropless_drop[0], 100 * r.dropless_drop[1],
              r.dropless_shapes_fixed ? "yes" : "no");
  std::printf(
      "  capacity: rows per (source rank, expert); buffer rows: the busiest expert's GEMM rows\n"
      "  (padded: every expert's), uniform / skewed for dropless\n");
}

void print(const overlap_result& r) {
  std::printf("  link: %s, %.0f us per exchange (sized from %.1f ms of experts)\n",
              rate(r.bandwidth).c_str(), r.latency * 1e6, r.experts_seconds * 1e3);
  std::printf("  %-22s %12s %12s %10s %8s\n", "schedule", "all-to-all ms", "exposed ms", "pass ms",
              "hidden");
  std::printf("  %-22s %12.2f %12.2f %10.2f %7.0f%%\n", "sequential", r.comm_sequential * 1e3,
              r.exposed_sequential * 1e3, r.total_sequential * 1e3,
              100 * (1 - r.exposed_sequential / r.comm_sequential));
  std::printf("  %-22s %12.2f %12.2f %10.2f %7.0f%%\n", format("pipelined<%d>", r.chunks).c_str(),
              r.comm_pipelined * 1e3, r.exposed_pipelined * 1e3, r.total_pipelined * 1e3,
              100 * r.overlap_pipelined);
  std::printf(
      "  timeline (pipelined, all ranks): chunk c+1's dispatch started before chunk c's experts "
      "ended at %d of %d chunk boundaries\n",
      r.overlapped_boundaries, r.boundaries);
  print(r.load);
}

void print(const trace_result& r) {
  if (r.token < 0) {
    std::printf("  no token of rank %d picked experts on two ranks\n", r.home_rank);
    return;
  }
  std::printf("  rank %d, token %d: router picks\n", r.home_rank, r.token);
  for (std::size_t k = 0; k < r.experts.size(); ++k)
    std::printf(
        "    k=%zu: expert %d (rank %d, local slot %d), weight %.4f; send row %.0f; the row "
        "rank %d received differs from x[t] by %.1g (relative)\n",
        k, r.experts[k], r.ranks[k], r.slots[k], r.weights[k], r.send_rows[k], r.ranks[k],
        r.input_diff[k]);
  const auto first = [](const std::vector<double>& v) {
    std::string s;
    for (std::size_t i = 0; i < 4 && i < v.size(); ++i) s += format(" %+9.5f", v[i]);
    return s + "  ...";
  };
  for (std::size_t k = 0; k < r.outputs.size(); ++k)
    std::printf("  %-34s%s\n", format("output of expert %d (returned)", r.experts[k]).c_str(),
                first(r.outputs[k]).c_str());
  std::printf(
      "  %-34s%s\n",
      format("%.4f * out%d + %.4f * out%d", r.weights[0], r.experts[0], r.weights[1], r.experts[1])
          .c_str(),
      first(r.combined).c_str());
  std::printf("  %-34s%s\n", "the layer's y[t]", first(r.layer_row).c_str());
  std::printf("  %-34s%s\n", "the reference's y[t]", first(r.reference_row).c_str());
}

void print(const straggler_result& r) {
  const int R = static_cast<int>(r.rows_before.size());
  std::printf("  hot expert %d lives on rank %d (placement::block)\n", r.hot_expert, r.hot_rank);
  header("", R, "rank");
  row("rows computed", r.rows_before);
  row("expert ms", r.expert_ms_before, " %8.2f");
  row("waits for the straggler, ms", r.wait_ms_before, " %8.2f");
  std::printf("  after placement::balance (%d extra slots; predicted max/mean %.2f):\n",
              r.extra_slots, r.predicted_max_over_mean);
  for (int s = 0; s < R; ++s) {
    std::printf("    rank %d holds", s);
    for (int e : r.experts_of_rank_after[s]) std::printf(" e%d", e);
    std::printf("\n");
  }
  row("rows computed", r.rows_after);
  row("expert ms", r.expert_ms_after, " %8.2f");
  row("waits for the straggler, ms", r.wait_ms_after, " %8.2f");
  std::printf("  straggler excess (max - mean) / mean: %.0f%% -> %.0f%%\n", 100 * r.excess_before,
              100 * r.excess_after);
  print(r.load);
}

// --- JSON ----------------------------------------------------------------------------------

struct json {
  std::string s;
  bool first = true;

  void key(const char* k) {
    s += first ? "\n    " : ",\n    ";
    first = false;
    s += "\"" + std::string(k) + "\": ";
  }
  static std::string val(double v) { return std::isfinite(v) ? format("%.9g", v) : "null"; }
  static std::string val(int v) { return std::to_string(v); }
  static std::string val(bool v) { return v ? "true" : "false"; }
  static std::string val(const std::string& v) {
    std::string out = "\"";
    for (char c : v) out += c == '"' || c == '\\' ? std::string("\\") + c : std::string(1, c);
    return out + "\"";
  }
  template <class T>
  static std::string val(const std::vector<T>& v) {
    std::string out = "[";
    for (std::size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + val(v[i]);
    return out + "]";
  }
  template <class T>
  json& operator()(const char* k, const T& v) {
    key(k);
    s += val(v);
    return *this;
  }
};

std::string to_json(const machine_load& m) {
  json j;
  j("calibration_ms_before", m.calibration_ms_before)(
      "calibration_ms_after", m.calibration_ms_after)("core_share", m.core_share)(
      "pass_spread", m.pass_spread)("busy", busy_because(m));
  return "{" + j.s + "}";
}

std::string to_json(const distribution_result& r) {
  json j;
  j("experts_of_rank", r.experts_of_rank)("bytes_per_rank", r.bytes_per_rank)(
      "gate_bytes", r.gate_bytes)("replicated_bytes", r.replicated_bytes)("saving", r.saving);
  return j.s;
}
std::string to_json(const exchanges_result& r) {
  json j;
  j("passes", r.passes)("counts_exchanges_per_pass", r.counts_exchanges_per_pass)(
      "row_exchanges_per_pass", r.row_exchanges_per_pass)(
      "same_on_every_rank_and_pass", r.same_on_every_rank_and_pass)("counts_bytes", r.counts_bytes)(
      "row_bytes", r.row_bytes)("dispatch_bytes", r.dispatch_bytes)(
      "combine_bytes", r.combine_bytes)("stats_dispatch_bytes", r.stats_dispatch_bytes)(
      "stats_combine_bytes", r.stats_combine_bytes)("stats_match", r.stats_match);
  return j.s;
}
std::string to_json(const compute_result& r) {
  json j;
  j("k", r.k)("experts", r.experts)("flops_per_token_topk", r.flops_per_token_topk)(
      "flops_per_token_dense", r.flops_per_token_dense)("flop_ratio", r.flop_ratio)(
      "expert_seconds_topk", r.expert_seconds_topk)("expert_seconds_dense", r.expert_seconds_dense)(
      "time_ratio", r.time_ratio);
  j.key("load");
  j.s += to_json(r.load);
  return j.s;
}
std::string to_json(const routing_result& r) {
  json j;
  j("hot_expert", r.hot_expert)("expert_rows_uniform", r.expert_rows_uniform)(
      "expert_rows_skewed", r.expert_rows_skewed)("rank_rows_uniform", r.rank_rows_uniform)(
      "rank_rows_skewed", r.rank_rows_skewed)("expert_max_over_mean_uniform",
                                              r.expert_max_over_mean_uniform)(
      "expert_max_over_mean_skewed", r.expert_max_over_mean_skewed)("rank_max_over_mean_uniform",
                                                                    r.rank_max_over_mean_uniform)(
      "rank_max_over_mean_skewed", r.rank_max_over_mean_skewed)("busiest_expert_skewed",
                                                                r.busiest_expert_skewed);
  return j.s;
}
std::string to_json(const capacity_result& r) {
  json j;
  std::vector<double> f, cap, buf, du, ds;
  std::vector<bool> fixed;
  for (const capacity_row& c : r.padded) {
    f.push_back(c.factor);
    cap.push_back(c.capacity);
    buf.push_back(c.buffer_rows);
    du.push_back(c.drop_uniform);
    ds.push_back(c.drop_skewed);
    fixed.push_back(c.shapes_fixed);
  }
  std::vector<int> fixed_int(fixed.begin(), fixed.end());
  j("factor", f)("capacity", cap)("buffer_rows", buf)("drop_uniform", du)("drop_skewed", ds)(
      "shapes_fixed", fixed_int)("dropless_shapes_fixed", r.dropless_shapes_fixed)(
      "dropless_busiest_rows", r.dropless_busiest_rows)("dropless_drop", r.dropless_drop);
  return j.s;
}
std::string to_json(const overlap_result& r) {
  json j;
  j("chunks", r.chunks)("bandwidth", r.bandwidth)("latency", r.latency)(
      "experts_seconds", r.experts_seconds)("comm_sequential", r.comm_sequential)(
      "exposed_sequential", r.exposed_sequential)("total_sequential", r.total_sequential)(
      "comm_pipelined", r.comm_pipelined)("exposed_pipelined", r.exposed_pipelined)(
      "total_pipelined", r.total_pipelined)("overlap_pipelined", r.overlap_pipelined)(
      "boundaries", r.boundaries)("overlapped_boundaries", r.overlapped_boundaries);
  j.key("load");
  j.s += to_json(r.load);
  return j.s;
}
std::string to_json(const trace_result& r) {
  json j;
  j("found", r.found)("home_rank", r.home_rank)("token", r.token)("experts", r.experts)(
      "ranks", r.ranks)("slots", r.slots)("weights", r.weights)("send_rows", r.send_rows)(
      "input_diff", r.input_diff)("outputs", r.outputs)("combined", r.combined)(
      "layer_row", r.layer_row)("reference_row", r.reference_row)(
      "combined_vs_layer", r.combined_vs_layer)("combined_vs_reference", r.combined_vs_reference);
  return j.s;
}
std::string to_json(const straggler_result& r) {
  json j;
  j("hot_expert", r.hot_expert)("hot_rank", r.hot_rank)("rows_before", r.rows_before)(
      "rows_after", r.rows_after)("expert_ms_before", r.expert_ms_before)(
      "expert_ms_after", r.expert_ms_after)("wait_ms_before", r.wait_ms_before)(
      "wait_ms_after", r.wait_ms_after)("straggler_before", r.straggler_before)(
      "straggler_after", r.straggler_after)("excess_before", r.excess_before)(
      "excess_after", r.excess_after)("predicted_max_over_mean", r.predicted_max_over_mean)(
      "extra_slots", r.extra_slots)("hot_copies", r.hot_copies)("experts_of_rank_after",
                                                                r.experts_of_rank_after);
  j.key("load");
  j.s += to_json(r.load);
  return j.s;
}

// --- the tour ------------------------------------------------------------------------------

const char* const titles[] = {
    "",
    "What expert parallelism distributes",
    "The communication pattern: two all-to-alls per pass",
    "Why compute per token stays small",
    "Data-dependent routing makes load uneven",
    "Capacity limits and padding",
    "Hiding all-to-all latency behind expert compute",
    "A token that picks two experts on two ranks",
    "The straggler, and replicas that remove it",
};

template <class World>
int run_tour(const World& world, const options& o, int only, const char* json_path) {
  const bool speak = world.prints();
  if (speak)
    std::printf(
        "epmoe tour: %d ranks (%s), E=%d experts, top-%d, H=%d, F=%d, %d tokens per rank, "
        "GEMM: %s\n",
        o.ranks, std::is_same_v<typename World::comm_type, comm::threads> ? "threads" : "MPI",
        experts, top_k, o.hidden, o.ffn, o.tokens, space::host_gemm_backend());
  std::string out = "{\n  \"options\": {" +
                    format(
                        "\"ranks\": %d, \"experts\": %d, \"top_k\": %d, \"hidden\": %d, "
                        "\"ffn\": %d, \"tokens\": %d",
                        o.ranks, experts, top_k, o.hidden, o.ffn, o.tokens) +
                    "}";
  const auto start = std::chrono::steady_clock::now();
  const auto step = [&](int n, auto&& experiment) {
    if (only != 0 && only != n) return;
    const auto t0 = std::chrono::steady_clock::now();
    const auto r = experiment();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (speak) {
      std::printf("\n%d. %s  [%.1f s]\n", n, titles[n], s);
      print(r);
      std::printf("  => %s\n", r.conclusion.c_str());
    }
    out += format(",\n  \"step%d\": {", n) + to_json(r) +
           ",\n    \"conclusion\": " + json::val(r.conclusion) +
           format(",\n    \"seconds\": %.3f", s) + "\n  }";
  };
  step(1, [&] { return what_ep_distributes(world, o); });
  step(2, [&] { return communication_pattern(world, o); });
  step(3, [&] { return compute_per_token(world, o); });
  step(4, [&] { return routing_imbalance(world, o); });
  step(5, [&] { return capacity_and_padding(world, o); });
  step(6, [&] { return hiding_latency(world, o); });
  step(7, [&] { return trace_one_token(world, o); });
  step(8, [&] { return the_straggler(world, o); });
  const double total =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (speak) std::printf("\ntour done in %.1f s\n", total);
  out += format(",\n  \"seconds\": %.3f\n}\n", total);
  if (json_path && speak) {
    std::ofstream f(json_path);
    f << out;
    if (!f) {
      std::fprintf(stderr, "epmoe_tour: cannot write %s\n", json_path);
      return 1;
    }
  }
  return 0;
}

bool under_mpiexec() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"})
    if (std::getenv(v)) return true;
  return false;
}

/// --help: the usage on stdout, exit 0; a wrong argument: the usage on stderr, exit 2.
int usage(std::FILE* to, int code) {
  std::fprintf(to,
               "usage: epmoe_tour [--step N (1-8)] [--json FILE] [--small] [--ranks R (2, 4, 8)] "
               "[--help]\n"
               "  the eight facts of expert parallelism, each shown by a measurement on the real "
               "layer\n"
               "  (docs/expert-parallelism.md); under mpiexec the ranks are MPI processes\n");
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  int only = 0, ranks = 4;
  bool small = false;
  const char* json_path = nullptr;
  // A wrong argument is named on stderr, then the usage (the examples' convention).
  const auto wrong = [](const char* what, const char* arg) {
    std::fprintf(stderr, "epmoe_tour: %s %s\n", what, arg);
    return usage(stderr, 2);
  };
  const auto integer = [](const char* s, int& out) {
    char* end = nullptr;
    const long v = std::strtol(s, &end, 10);
    out = static_cast<int>(v);
    return end != s && *end == '\0';
  };
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    const bool takes_value =
        !std::strcmp(a, "--step") || !std::strcmp(a, "--json") || !std::strcmp(a, "--ranks");
    if (takes_value && i + 1 >= argc) return wrong("missing the value after", a);
    if (!std::strcmp(a, "--step")) {
      if (!integer(argv[++i], only) || only < 1 || only > 8)
        return wrong("--step wants 1 to 8, not", argv[i]);
    } else if (!std::strcmp(a, "--json"))
      json_path = argv[++i];
    else if (!std::strcmp(a, "--ranks")) {
      if (!integer(argv[++i], ranks)) return wrong("--ranks wants a number, not", argv[i]);
    } else if (!std::strcmp(a, "--small"))
      small = true;
    else if (!std::strcmp(a, "--help") || !std::strcmp(a, "-h"))
      return usage(stdout, 0);
    else
      return wrong("unknown argument", a);
  }
  const auto opts = [&](int r) { return small ? options::small(r) : options{.ranks = r}; };
  const auto check = [](int r) {
    if (r >= 2 && experts % r == 0) return true;
    std::fprintf(stderr, "epmoe_tour: %d ranks: the tour needs 2, 4 or 8 (dividing %d experts)\n",
                 r, experts);
    return false;
  };
  if (under_mpiexec()) {
#ifdef EPMOE_HAS_MPI
    comm::mpi_session session(argc, argv);
    const mpi_ranks world;
    if (!check(world.size())) return 2;
    try {
      return run_tour(world, opts(world.size()), only, json_path);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "epmoe_tour: %s\n", e.what());
      MPI_Abort(MPI_COMM_WORLD, 1);  // the other ranks may wait in a collective
      return 1;
    }
#else
    std::fprintf(stderr,
                 "epmoe_tour: built without MPI; run it without mpiexec (threads are ranks)\n");
    return 2;
#endif
  }
  if (!check(ranks)) return 2;
  try {
    return run_tour(thread_ranks{ranks}, opts(ranks), only, json_path);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "epmoe_tour: %s\n", e.what());
    return 1;
  }
}
