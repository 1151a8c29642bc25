// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// The layer's backward on MPI processes (1 to 4) against reference::backward: every rank
// checks its own dx rows and, after reduce_gradients, the gate's sum and its slots' expert
// gradients (a replicated expert's copy holds the sum over its copies).
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "../layer/harness.hpp"
#include "world.hpp"
#include <epmoe/comm/mpi.hpp>
#include <epmoe/placement/table.hpp>
#include <epmoe/reference/backward.hpp>
#include <epmoe/schedule/pipelined.hpp>

// A namespace per file: test_mpi compiles its files as one unit.
namespace mpi_backward_tests {
using namespace epmoe;

namespace {

struct mpi_train : default_policies {
  using router = epmoe::router::topk_softmax<2>;
  using comm = epmoe::comm::mpi;
};
struct mpi_train_dedup : mpi_train {
  static constexpr epmoe::layer_options options{.dedup = true};
};
struct mpi_train_pipelined : mpi_train {
  using schedule = epmoe::schedule::pipelined<2>;
};
struct mpi_train_replicas : mpi_train {
  using placement = epmoe::placement::table;
};

template <class Placement>
Placement placement_for(const layer_config& cfg) {
  if constexpr (std::is_same_v<Placement, placement::table>) {
    std::vector<int> phy;  // each rank: its block, plus a copy of expert 0
    const int L = cfg.experts / cfg.ranks;
    for (int r = 0; r < cfg.ranks; ++r) {
      for (int j = 0; j < L; ++j) phy.push_back(r * L + j);
      phy.push_back(0);
    }
    return placement::table(cfg.experts, cfg.ranks, phy);
  } else {
    return Placement(cfg);
  }
}

// The relative error of this rank's view against the reference's slice of it.
double error_of(const float* got, const double* want, index_t n) {
  return test::relative_error(std::vector<float>(got, got + n), std::vector<float>(want, want + n));
}

template <class P>
void check_backward(layer_config cfg) {
  const int R = test::world_size(), me = test::world_rank();
  cfg.ranks = R;
  cfg.training = true;
  const index_t H = cfg.hidden, F = cfg.ffn, E = cfg.experts;
  const auto w = reference::full_weights::random(cfg, 71);
  std::vector<index_t> per(R);
  for (int r = 0; r < R; ++r) per[r] = 9 + 5 * r;
  const auto g = test::make_tokens(per, H, 72);
  const std::vector<float> dy = reference::random_tokens(g.total() * H, 1, 73);
  const typename P::placement where = placement_for<typename P::placement>(cfg);
  const index_t L = where.slots_per_rank();
  const auto mine = reference::slice(w, where, me);
  moe_layer<P> layer(cfg, comm::mpi(MPI_COMM_WORLD), {w.gate_view(), mine.experts()}, {}, {},
                     where);
  const index_t T = per[me], at = g.offset(me) * H;
  constexpr float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> y(T * H, nan), dx(T * H, nan), dgate(E * H, nan), dw1(L * F * H, nan),
      dw3(L * F * H, nan), dw2(L * H * F, nan);
  const typename moe_layer<P>::gradients grads{
      {dgate.data(), E, H}, {{dw1.data(), L, F, H}, {dw3.data(), L, F, H}, {dw2.data(), L, H, F}}};
  layer.forward({g.x.data() + at, T, H}, {y.data(), T, H});
  layer.backward({dy.data() + at, T, H}, {dx.data(), T, H}, grads);
  layer.reduce_gradients(grads);
  const reference::gradients want =
      reference::backward(w, typename P::router{}, capacity::dropless{}, where,
                          {g.x.data(), g.total(), H}, per, {dy.data(), g.total(), H});
  INFO("rank " << me << " of " << R);
  CHECK(error_of(dx.data(), want.dx.data() + at, T * H) <= 2e-5);
  CHECK(error_of(dgate.data(), want.dgate.data(), E * H) <= 2e-5);
  int slots = 0;
  for (index_t j = 0; j < L; ++j, ++slots) {
    const index_t e = where.expert_at(me, static_cast<int>(j));
    INFO("slot " << j << " expert " << e);
    CHECK(error_of(dw1.data() + j * F * H, want.dw1.data() + e * F * H, F * H) <= 2e-5);
    CHECK(error_of(dw3.data() + j * F * H, want.dw3.data() + e * F * H, F * H) <= 2e-5);
    CHECK(error_of(dw2.data() + j * H * F, want.dw2.data() + e * H * F, H * F) <= 2e-5);
  }
  CHECK(slots == L);
}

layer_config mpi_layer() {
  return {.hidden = 12, .ffn = 10, .experts = 12, .top_k = 2, .max_tokens = 32};
}

}  // namespace

TEST_CASE("mpi backward: dx and the reduced gradients equal the reference", "[mpi][backward]") {
  check_backward<mpi_train>(mpi_layer());
  check_backward<mpi_train_dedup>(mpi_layer());
  layer_config chunks = mpi_layer();
  chunks.chunks = 2;
  check_backward<mpi_train_pipelined>(chunks);
  check_backward<mpi_train_replicas>(mpi_layer());
}

TEST_CASE("mpi: ranks that make different calls all throw the same error, nothing is written",
          "[mpi][backward]") {
  const int R = test::world_size(), me = test::world_rank();
  if (R < 2) return;  // one rank cannot disagree with itself
  layer_config cfg{
      .hidden = 8, .ffn = 12, .experts = 2 * R, .top_k = 2, .ranks = R, .max_tokens = 8};
  cfg.training = true;
  cfg.chunks = 2;
  cfg.exchange_timeout = 30;
  const index_t H = cfg.hidden, F = cfg.ffn, E = cfg.experts, T = 8;
  const auto w = reference::full_weights::random(cfg, 81);
  const placement::block where(cfg);
  const index_t L = where.slots_per_rank();
  const auto mine = reference::slice(w, where, me);
  moe_layer<mpi_train_pipelined> layer(cfg, comm::mpi(MPI_COMM_WORLD),
                                       {w.gate_view(), mine.experts()});
  constexpr float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> x = reference::random_tokens(T, H, 82 + static_cast<std::uint64_t>(me)),
                           dy(T * H, 0.5f);
  std::vector<float> y(T * H), dx(T * H), dgate(E * H), dw1(L * F * H), dw3(L * F * H),
      dw2(L * H * F);
  const auto poison = [&] {
    for (auto* v : {&y, &dx, &dgate, &dw1, &dw3, &dw2}) std::fill(v->begin(), v->end(), nan);
  };
  const auto untouched = [&] {
    for (auto* v : {&y, &dx, &dgate, &dw1, &dw3, &dw2})
      for (float f : *v)
        if (!std::isnan(f)) return false;
    return true;
  };
  const moe_layer<mpi_train_pipelined>::gradients grads{
      {dgate.data(), E, H}, {{dw1.data(), L, F, H}, {dw3.data(), L, F, H}, {dw2.data(), L, H, F}}};
  const auto forward = [&] { layer.forward({x.data(), T, H}, {y.data(), T, H}); };
  const auto backward = [&] { layer.backward({dy.data(), T, H}, {dx.data(), T, H}, grads); };
  const auto thrown = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const config_error& e) {
      return e.field() + ": " + e.what();
    }
    return "none";
  };
  // Every rank gathers every rank's text: all must be the same.
  const auto same_everywhere = [&](const std::string& s) {
    std::vector<char> mine_text(256, 0), all(static_cast<std::size_t>(256 * R));
    std::copy_n(s.begin(), std::min<std::size_t>(s.size(), 255), mine_text.begin());
    MPI_Allgather(mine_text.data(), 256, MPI_CHAR, all.data(), 256, MPI_CHAR, MPI_COMM_WORLD);
    for (int r = 1; r < R; ++r)
      if (!std::equal(all.begin(), all.begin() + 256, all.begin() + 256 * r)) return false;
    return true;
  };
  forward();
  poison();
  int checked = 0;
  const std::string a = thrown([&] { me == 0 ? forward() : backward(); });
  INFO(a);
  CHECK(a.rfind("call: ", 0) == 0);
  CHECK(same_everywhere(a));
  CHECK(untouched());
  forward();
  backward();
  if (me == 0) layer.set_chunks(1);
  poison();
  const std::string b = thrown(forward);
  INFO(b);
  CHECK(b.find("chunks") != std::string::npos);
  CHECK(same_everywhere(b));
  CHECK(untouched());
  layer.set_chunks(2);
  const std::string c = thrown([&] { me == R - 1 ? layer.reduce_gradients(grads) : forward(); });
  INFO(c);
  CHECK(c.find("reduce_gradients") != std::string::npos);
  CHECK(same_everywhere(c));
  CHECK(untouched());
  forward();
  backward();
  layer.reduce_gradients(grads);
  CHECK(std::isfinite(dx[0]));
  CHECK(std::isfinite(dgate[0]));
  checked += 3;
  CHECK(checked == 3);
}

}  // namespace mpi_backward_tests
