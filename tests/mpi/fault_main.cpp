// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// One forward pass on MPI processes in which the last rank fails on purpose inside its
// experts (issue 23): `throws`, `stalls` (past exchange_timeout) or `exits` (a crash). Every
// rank prints one line, "epmoe-fault rank R: KIND after S s, y untouched|WRITTEN: WHAT", and
// ends without MPI_Finalize (a collective cannot be cancelled). tests/mpi/faults.sh runs it
// and checks the lines. EPMOE_FAULT_EXCHANGE=low_latency runs the low-latency exchange
// (issue 38: its writes into the peers' windows) instead of the default one, and with
// EPMOE_FAULT_MESSAGES=1 its point-to-point round (comm::mpi without windows);
// EPMOE_FAULT_SPLIT=1 runs the pass split, start then finish (the round posted by start).
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "../layer/faults.hpp"
#include "../layer/harness.hpp"
#include <epmoe/comm/mpi.hpp>

using namespace epmoe;

namespace {
struct policies : default_policies {
  using space = test::faulty_host;
  using comm = epmoe::comm::mpi;
};
struct low_latency_policies : policies {
  static constexpr layer_options options{.low_latency = true};
};

template <class policies>
int run(test::faulty_host::fault f, double timeout, bool split) {
  const char* messages = std::getenv("EPMOE_FAULT_MESSAGES");
  comm::mpi c(MPI_COMM_WORLD, 8, !(messages && std::string(messages) == "1"));
  const int me = c.rank(), R = c.size(), culprit = R - 1;
  layer_config cfg{
      .hidden = 16, .ffn = 24, .experts = 2 * R, .top_k = 2, .ranks = R, .max_tokens = 24};
  cfg.exchange_timeout = timeout;
  const auto w = reference::full_weights::random(cfg, 3);
  const placement::block where(cfg);
  test::rank_arrays<policies> arrays(w, reference::slice(w, where, me));
  const test::faulty_host space =
      me == culprit ? test::faulty_host(f, 4 * timeout) : test::faulty_host();
  moe_layer<policies> layer(cfg, std::move(c), arrays.views(cfg, where.slots_per_rank()), {}, {},
                            where, space);
  const index_t T = 24, H = cfg.hidden;
  const auto x = reference::random_tokens(T, H, 10 + me);
  std::vector<float> y(static_cast<std::size_t>(T * H), std::numeric_limits<float>::quiet_NaN());
  std::string kind = "none", what;
  const auto start = std::chrono::steady_clock::now();
  try {
    if (split)
      layer.finish(layer.start({x.data(), T, H}, {y.data(), T, H}));
    else
      layer.forward({x.data(), T, H}, {y.data(), T, H});
  } catch (const comm_timeout& e) {
    kind = "comm_timeout", what = e.what();
  } catch (const comm_aborted& e) {
    kind = "comm_aborted(origin " + std::to_string(e.origin()) + ")", what = e.what();
  } catch (const std::exception& e) {
    kind = "error", what = e.what();
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  bool untouched = true;
  for (float v : y) untouched = untouched && std::isnan(v);
  std::printf("epmoe-fault rank %d: %s after %.2f s, y %s: %s\n", me, kind.c_str(), s,
              untouched ? "untouched" : "WRITTEN", what.c_str());
  std::fflush(stdout);
  // Meet the ranks that are alive on the world communicator (the layer's duplicate holds an
  // exchange that cannot be cancelled), so that no rank's line is lost to the launcher ending
  // the job, then end without MPI_Finalize.
  MPI_Request barrier = MPI_REQUEST_NULL;
  MPI_Ibarrier(MPI_COMM_WORLD, &barrier);
  const auto until =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(5 * timeout + 5);
  for (int done = 0; !done && std::chrono::steady_clock::now() < until;) {
    MPI_Test(&barrier, &done, MPI_STATUS_IGNORE);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::_Exit(kind == "none" ? 3 : 0);
}
}  // namespace

int main(int argc, char** argv) {
  comm::mpi_session session(argc, argv);
  const std::string scenario = argc > 1 ? argv[1] : "";
  const double timeout = argc > 2 ? std::atof(argv[2]) : 2.0;
  using fault = test::faulty_host::fault;
  const fault f = scenario == "throws"   ? fault::throws
                  : scenario == "stalls" ? fault::stalls
                  : scenario == "exits"  ? fault::exits
                                         : fault::none;
  if (f == fault::none) {
    std::fprintf(stderr, "usage: test_mpi_faults throws|stalls|exits [timeout seconds]\n");
    return 2;
  }
  const char* exchange = std::getenv("EPMOE_FAULT_EXCHANGE");
  const char* split = std::getenv("EPMOE_FAULT_SPLIT");
  const bool is_split = split && std::string(split) == "1";
  if (exchange && std::string(exchange) == "low_latency")
    return run<low_latency_policies>(f, timeout, is_split);
  return run<policies>(f, timeout, is_split);
}
