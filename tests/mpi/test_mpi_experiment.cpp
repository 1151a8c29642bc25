// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// epmoe::experiment on MPI processes (mpi_ranks) builds the same table as on threads of one
// process: the same counts, the reference's error, on every rank.
#include <catch2/catch.hpp>

#include <epmoe/comm/mpi.hpp>
#include <epmoe/experiment.hpp>

// A namespace per file: test_mpi compiles its files as one unit.
namespace mpi_experiment_tests {
using namespace epmoe;

namespace {

template <bool Dedup>
struct top2 : default_policies {
  using router = epmoe::router::topk_softmax<2>;
  using capacity = epmoe::capacity::factor<false>;
  using comm = epmoe::comm::threads;  // replaced by the experiment's ranks
  static constexpr layer_options options{.dedup = Dedup};
};

}  // namespace

TEST_CASE("mpi experiment: the table on processes equals the table on threads", "[mpi]") {
  const experiment::mpi_ranks ranks;
  const int R = ranks.size();
  const layer_config cfg{.hidden = 10,
                         .ffn = 8,
                         .experts = 12,
                         .top_k = 2,
                         .ranks = R,
                         .max_tokens = 20,
                         .capacity_factor = 1.0};
  const auto in = experiment::inputs::skewed(cfg, 11, 2, 2.0);
  using bundles = experiment::list<experiment::bundle<"top-2", top2<false>>,
                                   experiment::bundle<"top-2 dedup", top2<true>>>;
  const experiment::options opt{.passes = 2, .topology = "cpu_cluster"};
  const auto procs = experiment::run(bundles{}, ranks, in, opt);
  const auto threads = experiment::run(bundles{}, experiment::thread_ranks{R}, in, opt);
  int checked = 0;
  for (std::size_t b = 0; b < 2; ++b, ++checked) {
    CAPTURE(b, R);
    CHECK(procs[b].error <= 1e-4);
    CHECK(procs[b].dispatch_rows == threads[b].dispatch_rows);
    CHECK(procs[b].combine_bytes == threads[b].combine_bytes);
    CHECK(procs[b].dropped == threads[b].dropped);
    CHECK(procs[b].peak_recv_rows == threads[b].peak_recv_rows);
    CHECK(procs[b].straggler == threads[b].straggler);
    CHECK(procs[b].predicted_seconds == Approx(threads[b].predicted_seconds));
  }
  CHECK(checked == 2);
}

}  // namespace mpi_experiment_tests
