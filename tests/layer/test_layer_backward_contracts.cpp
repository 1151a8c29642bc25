// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// The layer's backward contracts: bad arguments throw on every rank and nothing is written,
// training off and the loss scales are named, the token ids are the forward's, a given
// routing's zero gate gradients, a pass is a value whose handle backward consumes once, and
// deterministic passes are bit-identical. Every output starts as NaN.
#include "backward_harness.hpp"

namespace layer_backward_tests {

// Rank 1 passes a bad dy: every rank throws and nothing is written, on any space: not dx, not
// a routed or shared expert's gradient, not the shared gate's or the output bias's (the home
// terms' backward may run before the verdict: sequential runs shared() first), and with
// padded capacity (static shapes: a device never defers a backward's verdict).
template <class P>
void rejected_backward(bool home_terms) {
  layer_config cfg = train_layer(2);
  cfg.training = true;
  if (home_terms) cfg.shared_experts = 1, cfg.shared_gate = true, cfg.output_bias = true;
  const auto w = reference::full_weights::random(cfg, 21);
  const auto g = test::make_tokens({10, 10}, cfg.hidden, 22);
  const index_t H = cfg.hidden, T = 10;
  std::vector<std::string> caught(2);
  std::vector<int> untouched(2, 0), recovered(2, 0), looked(2, 0);
  comm::threads_world world(2);
  world.run([&](typename P::comm c) {
    const int r = c.rank();
    const placement::block where(cfg);
    const index_t L = where.slots_per_rank();
    test::rank_arrays<P> arrays(w, reference::slice(w, where, r));
    const test_space space{};
    moe_layer<P> layer(cfg, c, arrays.views(cfg, L), {}, {}, where, space);
    const auto x = io::upload(std::span(g.x).subspan(static_cast<std::size_t>(r * T * H), T * H));
    auto y = io::upload(std::vector<float>(T * H)), dy = io::upload(std::vector<float>(T * H, .5f)),
         dx = io::upload(std::vector<float>(T * H));
    io::poison(dx, space);
    grad_arrays<expert::swiglu> grads(cfg, L);
    const auto views = grads.template views<P>(cfg, L);
    const auto all_nan = [&] {
      grads.download(space);
      int n = 0;
      for (const auto* v : {&grads.gate, &grads.w1, &grads.w3, &grads.w2, &grads.s1, &grads.s3,
                            &grads.s2, &grads.sgate, &grads.obias})
        for (float f : *v) {
          if (!std::isnan(f)) return false;
          ++n;
        }
      for (float f : io::download(dx, space))
        if (!std::isnan(f)) return false;
      looked[r] = n;
      return true;
    };
    const auto attempt = [&](auto&& f) -> std::string {
      try {
        f();
      } catch (const input_error& e) {
        return std::string("input_error ") + e.field();
      } catch (const config_error& e) {
        return std::string("config_error ") + e.field();
      }
      return "none";
    };
    const matrix_view<const float> xv(io::data(x), T, H);
    const matrix_view<float> yv(io::data(y), T, H), dxv(io::data(dx), T, H);
    // Before any forward: every rank rejects (none has saved state).
    const std::string first = attempt([&] { layer.backward({io::data(dy), T, H}, dxv, views); });
    layer.forward(xv, yv);
    // Rank 1 passes dy one column short: it names dy, rank 0 hears of it.
    const std::string bad = attempt([&] {
      layer.backward({io::data(dy), T, r == 1 ? H - 1 : H}, dxv, views);
      layer.synchronize();
    });
    untouched[r] = all_nan();
    // The state was consumed: a second backward is refused; a new forward makes it work.
    const std::string again = attempt([&] { layer.backward({io::data(dy), T, H}, dxv, views); });
    layer.forward(xv, yv);
    layer.backward({io::data(dy), T, H}, dxv, views);
    recovered[r] = !all_nan() && layer.stats().backward && layer.stats().saved_bytes > 0;
    caught[r] = first + " | " + bad + " | " + again;
  });
  INFO("home terms " << home_terms << ", pads " << P::capacity::pads);
  CHECK(caught[0] ==
        "config_error backward | input_error backward inputs of rank 1 | "
        "config_error backward");
  CHECK(caught[1] == "config_error backward | config_error dy | config_error backward");
  CHECK(untouched == std::vector<int>{1, 1});
  CHECK(recovered == std::vector<int>{1, 1});
  const index_t F = cfg.ffn, E = cfg.experts;
  // gate, the routed experts' w1, w3, w2, the output bias's (always sized), and the shared
  // expert's and its gate's.
  const index_t expect = E * H + 3 * (E / 2) * F * H + H + (home_terms ? 3 * F * H + H : 0);
  CHECK(looked == std::vector<int>(2, static_cast<int>(expect)));
}

TEST_CASE("layer backward: bad arguments throw on every rank, nothing is written",
          "[layer][backward]") {
  rejected_backward<train_policies<router::topk_softmax<2>>>(false);
  // Shared experts, their gate and the output bias: their gradients are the home rank's.
  rejected_backward<train_policies<router::topk_softmax<2>>>(true);
  rejected_backward<train_policies<router::topk_softmax<2>, capacity::dropless, expert::swiglu,
                                   schedule::pipelined<2>>>(true);
  rejected_backward<train_policies<router::topk_softmax<2>, capacity::factor<true>>>(true);
}

// Host-only: these build layers over host arrays directly.
#ifndef EPMOE_TEST_SPACES_ONLY_GENERIC
TEST_CASE("layer backward: config training off is named, the saved bytes are reported",
          "[layer][backward]") {
  struct P : train_policies<router::topk_softmax<2>> {
    using comm = epmoe::comm::local;
  };
  const layer_config cfg = train_layer(1);
  const auto w = reference::full_weights::random(cfg, 31);
  const index_t H = cfg.hidden, T = 16, E = cfg.experts, K = 2;
  const auto g = test::make_tokens({T}, H, 32);
  std::vector<float> y(T * H), dy(T * H, 1.f), dx(T * H, nan_f);
  test::rank_arrays<P> arrays(w, reference::slice(w, placement::block(cfg), 0));
  grad_arrays<expert::swiglu> grads(cfg, E);
  {
    moe_layer<P> layer(cfg, comm::local{}, arrays.views(cfg, E));
    layer.forward({g.x.data(), T, H}, {y.data(), T, H});
    try {
      layer.backward({dy.data(), T, H}, {dx.data(), T, H}, grads.views<P>(cfg, E));
      FAIL("backward without config training ran");
    } catch (const config_error& e) {
      CHECK(std::string(e.field()) == "config.training");
    }
    CHECK(layer.stats().saved_bytes == 0);
  }
  layer_config training = cfg;
  training.training = true;
  training.recompute = true;
  index_t recomputed = 0;
  {
    moe_layer<P> layer(training, comm::local{}, arrays.views(cfg, E));
    layer.forward({g.x.data(), T, H}, {y.data(), T, H});
    const pass_stats& s = layer.stats();
    CHECK_FALSE(s.backward);
    // Every expert row's input (T*K rows, dropless), the routing and the logits.
    CHECK(s.saved_bytes == T * K * H * 4 + T * K * 8 + T * E * 4);
    recomputed = s.saved_bytes;
  }
  // Without recompute the experts' two hidden layers too (F = 10 padded to 12 floats).
  training.recompute = false;
  moe_layer<P> layer(training, comm::local{}, arrays.views(cfg, E));
  layer.forward({g.x.data(), T, H}, {y.data(), T, H});
  CHECK(layer.stats().saved_bytes == recomputed + T * K * 2 * 12 * 4);
  CHECK(layer.stats().expert_flops == double(T * K) * 6 * H * cfg.ffn);
  // Backward's expert FLOPs: 6 GEMMs of the forward's 3 (the kept layers are not recomputed).
  layer.backward({dy.data(), T, H}, {dx.data(), T, H}, grads.views<P>(cfg, E));
  CHECK(layer.stats().backward);
  CHECK(layer.stats().expert_flops == double(T * K) * 12 * H * cfg.ffn);
}

TEST_CASE("layer backward: loss scales on a router whose losses have no gradient are named",
          "[layer][backward]") {
  struct P : train_policies<router::noisy_topk<2>> {
    using comm = epmoe::comm::local;
  };
  layer_config cfg = train_layer(1);
  cfg.training = true;
  const auto w = reference::full_weights::random(cfg, 33);
  const index_t H = cfg.hidden, T = 8, E = cfg.experts;
  const auto g = test::make_tokens({T}, H, 34);
  std::vector<float> y(T * H), dy(T * H, 1.f), dx(T * H, nan_f);
  test::rank_arrays<P> arrays(w, reference::slice(w, placement::block(cfg), 0));
  grad_arrays<expert::swiglu> grads(cfg, E);
  moe_layer<P> layer(cfg, comm::local{}, arrays.views(cfg, E));
  layer.forward({g.x.data(), T, H}, {y.data(), T, H});
  std::string field;
  try {
    layer.backward({dy.data(), T, H}, {dx.data(), T, H}, grads.views<P>(cfg, E),
                   {.losses = {.z = 1.0}});
  } catch (const config_error& e) {
    field = e.field();
  }
  CHECK(field == "backward_options.losses");
  CHECK(std::isnan(dx[0]));
}

TEST_CASE("layer backward: the token ids are the forward's, whatever the caller's memory holds",
          "[layer][backward]") {
  // Noisy top-k seeds each token's noise with its id; backward draws the same noise again.
  router::noisy_topk<2> r;
  r.training = true;
  r.seed = 11;
  std::vector<std::int64_t> ids(48);
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::int64_t>(i * 31 % 17);
  check_step<train_policies<router::noisy_topk<2>>>(
      train_layer(2), {.router = r, .token_ids = ids, .scramble_ids = true});
}

TEST_CASE("layer backward: a given routing writes zeros into the gate's and noise gate's gradients",
          "[layer][backward]") {
  struct P : train_policies<router::noisy_topk<2>> {
    using comm = epmoe::comm::local;
  };
  layer_config cfg = train_layer(1);
  cfg.training = true;
  const auto w = reference::full_weights::random(cfg, 35);
  const index_t H = cfg.hidden, T = 6, E = cfg.experts;
  const auto g = test::make_tokens({T}, H, 36);
  std::vector<float> y(T * H, nan_f), dy(T * H, 1.f), dx(T * H, nan_f);
  std::vector<std::int32_t> rid(T * 2);
  std::vector<float> rw(T * 2, 0.5f);
  for (index_t t = 0; t < T; ++t) rid[t * 2] = t % E, rid[t * 2 + 1] = (t + 3) % E;
  test::rank_arrays<P> arrays(w, reference::slice(w, placement::block(cfg), 0));
  grad_arrays<expert::swiglu> grads(cfg, E);
  router::noisy_topk<2> r;
  r.training = true;
  moe_layer<P> layer(cfg, comm::local{}, arrays.views(cfg, E), r);
  layer.forward({g.x.data(), T, H}, {{rid.data(), T, 2}, {rw.data(), T, 2}}, {y.data(), T, H});
  layer.backward({dy.data(), T, H}, {dx.data(), T, H}, grads.views<P>(cfg, E));
  grads.download(test_space{});
  int zeros = 0;
  for (const auto* v : {&grads.gate, &grads.noise})
    for (float f : *v) zeros += f == 0.f;
  CHECK(zeros == 2 * E * H);
  for (float f : dx) CHECK(std::isfinite(f));
}

TEST_CASE("layer backward: a pass is a value, backward consumes its handle once",
          "[layer][backward]") {
  struct P : train_policies<router::topk_softmax<2>> {
    using comm = epmoe::comm::local;
  };
  layer_config cfg = train_layer(1);
  const auto w = reference::full_weights::random(cfg, 37);
  const index_t H = cfg.hidden, T = 8, E = cfg.experts;
  const auto g = test::make_tokens({T}, H, 38);
  std::vector<float> y(T * H, nan_f), dy(T * H, 1.f), dx(T * H, nan_f);
  test::rank_arrays<P> arrays(w, reference::slice(w, placement::block(cfg), 0));
  grad_arrays<expert::swiglu> grads(cfg, E);
  const auto views = grads.views<P>(cfg, E);
  {  // Inference: the handle says there is nothing to go back through.
    moe_layer<P> layer(cfg, comm::local{}, arrays.views(cfg, E));
    const auto h = layer.forward({g.x.data(), T, H}, {y.data(), T, H});
    CHECK_FALSE(h.training);
    CHECK(h.id == 0);
  }
  cfg.training = true;
  moe_layer<P> layer(cfg, comm::local{}, arrays.views(cfg, E));
  const auto first = layer.forward({g.x.data(), T, H}, {y.data(), T, H});
  const auto second = layer.forward({g.x.data(), T, H}, {y.data(), T, H});
  CHECK(first.training);
  CHECK(second.id == first.id + 1);
  const auto refused = [&](auto h) -> std::string {
    try {
      layer.backward(h, {dy.data(), T, H}, {dx.data(), T, H}, views);
    } catch (const config_error& e) {
      return e.what();
    }
    return "";
  };
  // The layer keeps the last pass only: the first one's handle is stale.
  const std::string stale = refused(first);
  INFO(stale);
  CHECK(stale.find("pass 0") != std::string::npos);
  CHECK(stale.find("pass 1") != std::string::npos);
  CHECK(std::isnan(dx[0]));
  CHECK(refused(second).empty());
  CHECK(std::isfinite(dx[0]));
  // Consumed: once.
  CHECK(refused(second).find("consumed") != std::string::npos);
}
#endif

template <class Schedule>
struct deterministic_policies
    : train_policies<router::topk_softmax<2>, capacity::dropless, expert::swiglu, Schedule> {
  static constexpr layer_options options{.deterministic = true};
};

TEST_CASE("layer backward: deterministic, bit-identical across runs, allocations and timing",
          "[layer][backward]") {
  // Each run allocates its weights and buffers afresh (other alignments; without the option
  // the host's streaming GEMM then sums in another order) on 4 ranks whose threads interleave
  // differently every time.
  layer_config cfg = train_layer(4);
  cfg.chunks = 2;
  using P = deterministic_policies<schedule::pipelined<2>>;
  const auto w = reference::full_weights::random(cfg, 41);
  const auto g = test::make_tokens({20, 20, 20, 20}, cfg.hidden, 42);
  const auto dy = random_dy(g.total() * cfg.hidden, 43);
  const train_result a = train_step<P>(cfg, w, g, dy);
  for (int run = 0; run < 4; ++run) {
    const train_result b = train_step<P>(cfg, w, g, dy);
    int compared = 0;
    for (auto m : {&train_result::y, &train_result::dx, &train_result::dgate, &train_result::dw1,
                   &train_result::dw3, &train_result::dw2}) {
      REQUIRE((a.*m).size() == (b.*m).size());
      CHECK(same_bits(a.*m, b.*m));
      double worst = 0;
      for (std::size_t i = 0; i < (a.*m).size(); ++i)
        worst = std::max(worst, double(std::abs((a.*m)[i] - (b.*m)[i])));
      INFO("worst " << worst);
      CHECK(worst == 0);
      ++compared;
    }
    CHECK(compared == 6);
  }
  // Across rank counts: the same gradients within fp32 rounding.
  layer_config one = cfg;
  one.ranks = 1;
  one.max_tokens = 80;
  using S = deterministic_policies<schedule::sequential>;
  const auto g1 = test::make_tokens({80}, cfg.hidden, 42);
  REQUIRE(g1.x == g.x);
  const train_result c = train_step<S>(one, w, g1, dy);
  CHECK(test::relative_error(c.dx, a.dx) <= 1e-5);
  CHECK(test::relative_error(c.dgate, a.dgate) <= 1e-5);
  CHECK(test::relative_error(c.dw1, a.dw1) <= 1e-5);
}

}  // namespace layer_backward_tests
