// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// The layer over group-wise packed experts (int4, int4_asym, int8_group; issue 37): SwiGLU
// experts on 1, 2 and 4 thread ranks, every kernel path this CPU runs (W4A16 / W8A16
// portable, AVX2, AVX-512; W4A8 / W8A8 on VNNI), against the fp32 reference, within an error
// bound derived from the format (docs/quantisation.md, "Error bound"); forward only.
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <vector>

#include "harness.hpp"
#include <epmoe/reference/quantised.hpp>

using namespace epmoe;
using space::cpu_path;

namespace {

template <cpu_path Path>
struct host_on : space::host {
  host_on() { set_cpu_path(Path); }
};

// Packs in a format chosen at run time: after a first (fp32) pass, pack_weights(format).
template <class Space>
struct group_policies : default_policies {
  using space = Space;
  using router = epmoe::router::topk_softmax<2>;
  using comm = epmoe::comm::threads;
};

// One GEMM's relative rms error from rounding each weight to its group's step s (the scale):
// the error is at most s / 2, about uniform, rms s / sqrt(12); per row sqrt(Σ_groups n s² / 12)
// against the row's norm. The largest over the rows of [count * rows, K] weights.
double weight_rounding(const std::vector<float>& w, index_t rows, index_t K, weights_format f) {
  const auto q = reference::group_weights::quantise({w.data(), rows, K}, f);
  double worst = 0;
  for (index_t r = 0; r < rows; ++r) {
    double err = 0, ss = 0;
    for (index_t k = 0; k < K; ++k) {
      const double s = q.s(r, k);
      err += s * s / 12;
      ss += double{w[std::size_t(r * K + k)]} * w[std::size_t(r * K + k)];
    }
    if (ss > 0) worst = std::max(worst, std::sqrt(err / ss));
  }
  return worst;
}

// The token's rounding on VNNI (W4A8, W8A8), as for int8_channel: at most sqrt(K) / (127
// sqrt(12)) whatever the row.
double token_rounding(index_t K) { return std::sqrt(double(K)) / (127 * std::sqrt(12.0)); }

// The layer's bound, as test_layer_int8.cpp's: 3 sqrt(4 e1² + e3² + e2²), e = sqrt(weight² +
// token²) per projection (the gate's error through silu, gain <= 2), the routed experts' or
// the shared ones', whichever is larger.
double group_bound(const layer_config& cfg, const reference::full_weights& w, weights_format f,
                   bool a8) {
  const index_t H = cfg.hidden, F = cfg.ffn, Fs = cfg.shared_ffn, E = cfg.experts;
  const index_t N = cfg.shared_experts;
  const auto pair = [](double a, double b) { return std::sqrt(a * a + b * b); };
  const double th = a8 ? token_rounding(H) : 0, tf = a8 ? token_rounding(F) : 0,
               ts = a8 ? token_rounding(Fs) : 0;
  const auto layer = [](double e1, double e3, double e2) {
    return 3 * std::sqrt(4 * e1 * e1 + e3 * e3 + e2 * e2);
  };
  double bound = layer(pair(weight_rounding(w.w1, E * F, H, f), th),
                       pair(weight_rounding(w.w3, E * F, H, f), th),
                       pair(weight_rounding(w.w2, E * H, F, f), tf));
  if (N > 0)
    bound = std::max(bound, layer(pair(weight_rounding(w.shared_w1, N * Fs, H, f), th),
                                  pair(weight_rounding(w.shared_w3, N * Fs, H, f), th),
                                  pair(weight_rounding(w.shared_w2, N * H, Fs, f), ts)));
  return bound;
}

double rms_error(const std::vector<float>& got, const std::vector<float>& want) {
  double d = 0, n = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return std::numeric_limits<double>::infinity();
    d += (double{got[i]} - want[i]) * (double{got[i]} - want[i]);
    n += double{want[i]} * want[i];
  }
  return std::sqrt(d / std::max(n, 1e-300));
}

template <cpu_path Path>
int check_path() {
  if (!space::cpu_runs(Path)) return 0;
  using P = group_policies<host_on<Path>>;
  const space::int8_kernel kernel = space::int8_kernel_for(Path);
  const bool a8 = kernel == space::int8_kernel::avx512_vnni;
  int runs = 0;
  for (weights_format f :
       {weights_format::int4_g32, weights_format::int4_asym_g128, weights_format::int8_g32})
    for (int R : {1, 2, 4})
      for (index_t T : {1, 7, 61}) {
        const layer_config cfg{.hidden = 67,  // odd: the last group partial, no whole quad
                               .ffn = 90,
                               .experts = 8,
                               .top_k = 2,
                               .ranks = R,
                               .max_tokens = static_cast<int>(T),
                               .shared_experts = 1,
                               .shared_ffn = 45};
        const auto w = reference::full_weights::random(cfg, 41 + R);
        const auto g = test::make_tokens(std::vector<index_t>(R, T), cfg.hidden, 5 * R + T);
        test::run_options<P> opt{.passes = 2};
        opt.between = [f](moe_layer<P>& layer) { layer.pack_weights(f); };
        const auto got = test::run_layer<P>(cfg, w, g, opt);
        const auto want = test::run_reference<P>(cfg, w, g);
        const double fp32 = rms_error(got.ys[0], want);  // the first pass, unpacked
        const double err = rms_error(got.y, want), bound = group_bound(cfg, w, f, a8);
        INFO(space::name_of(kernel, f) << " group " << f.group << " R=" << R << " T=" << T
                                       << " error " << err << " bound " << bound);
        CHECK(fp32 < 1e-5);
        CHECK(err <= bound);
        CHECK(err >= bound / 100);  // the rounding shows: the format did run
        // The check can fail: outputs 3 bounds off in scale exceed it.
        std::vector<float> off = got.y;
        for (float& v : off) v *= static_cast<float>(1 + 3 * bound);
        CHECK(rms_error(off, want) > bound);
        ++runs;
      }
  return runs;
}

}  // namespace

TEST_CASE("int4 layer: within the format's error bound of the fp32 reference, every path") {
  int runs = 0;
  runs += check_path<cpu_path::portable>();
  runs += check_path<cpu_path::avx2>();
  runs += check_path<cpu_path::avx512>();  // VNNI where the CPU has it
  CHECK(runs >= 27);
}

TEST_CASE("int4 layer: forward only, a backward over group-wise copies is refused") {
  layer_config cfg{.hidden = 19, .ffn = 23, .experts = 4, .top_k = 2, .max_tokens = 5};
  cfg.training = true;
  const auto w = reference::full_weights::random(cfg, 3);
  auto mine = reference::slice(w, placement::block(cfg), 0);
  moe_layer<default_policies> layer(cfg, comm::local{}, {w.gate_view(), mine.experts()});
  const index_t T = 5, H = cfg.hidden, F = cfg.ffn, E = cfg.experts;
  const auto x = reference::random_tokens(T, H, 4);
  std::vector<float> g0(std::size_t(E * H)), g1(std::size_t(E * F * H)), g3(g1.size()),
      g2(g1.size());
  moe_layer<default_policies>::gradients grads;
  grads.gate = {g0.data(), E, H};
  grads.experts = {{g1.data(), E, F, H}, {g3.data(), E, F, H}, {g2.data(), E, H, F}};
  for (weights_format f :
       {weights_format::int4_g128, weights_format::int4_asym_g32, weights_format::int8_g32}) {
    layer.pack_weights(f);
    std::vector<float> y(x.size(), std::numeric_limits<float>::quiet_NaN()), dy(x.size(), 0.5f),
        dx(x.size());
    layer.forward({x.data(), T, H}, {y.data(), T, H});
    for (float v : y) CHECK(std::isfinite(v));
    CHECK_THROWS_WITH(layer.backward({dy.data(), T, H}, {dx.data(), T, H}, grads),
                      Catch::Contains(std::string("pack_weights = ") + f.name()) &&
                          Catch::Contains("forward only"));
  }
}

TEST_CASE("int4 layer: packed_matrix takes a checkpoint's quantised values, matrix by matrix") {
  // Layer B holds weights w but is given, matrix by matrix, the quantised values of other
  // weights w2; layer C holds w2 and packs them itself: the same bits out. Tensors in
  // SwiGLU's order (w1, w3, w2), then the shared expert's.
  const layer_config cfg{.hidden = 40,
                         .ffn = 36,
                         .experts = 4,
                         .top_k = 2,
                         .max_tokens = 9,
                         .shared_experts = 1,
                         .shared_ffn = 20};
  const auto w = reference::full_weights::random(cfg, 7);
  auto w2 = reference::full_weights::random(cfg, 8);
  w2.gate = w.gate;  // the same routing
  const auto mine = reference::slice(w, placement::block(cfg), 0);
  const auto theirs = reference::slice(w2, placement::block(cfg), 0);
  const weights_format f = weights_format::int4_asym_g32;
  using L = moe_layer<default_policies>;
  L b(cfg, comm::local{}, {w.gate_view(), mine.experts(), w.shared()});
  L c(cfg, comm::local{}, {w2.gate_view(), theirs.experts(), w2.shared()});
  CHECK_THROWS_WITH(b.packed_matrix(0, 0), Catch::Contains("pack_weights() first"));
  b.pack_weights(f);
  c.pack_weights(f);
  const index_t H = cfg.hidden, F = cfg.ffn, Fs = cfg.shared_ffn;
  const std::vector<float>* given[] = {&theirs.w1,    &theirs.w3,    &theirs.w2,
                                       &w2.shared_w1, &w2.shared_w3, &w2.shared_w2};
  int filled = 0;
  for (int t = 0; t < 6; ++t) {
    const bool shared = t >= 3;
    const index_t rows = t % 3 == 2 ? H
                         : shared   ? Fs
                                    : F,
                  cols = t % 3 == 2 ? (shared ? Fs : F) : H;
    for (index_t j = 0; j < (shared ? 1 : cfg.experts); ++j) {
      const auto q =
          reference::group_weights::quantise({given[t]->data() + j * rows * cols, rows, cols}, f);
      b.packed_matrix(t, j).repack_grouped(f, {q.q.data(), rows, cols}, q.scale.data(),
                                           q.offset.data());
      ++filled;
    }
  }
  CHECK(filled == 3 * 4 + 3);
  CHECK_THROWS_WITH(b.packed_matrix(6, 0), Catch::Contains("names no packed matrix"));
  CHECK_THROWS_WITH(b.packed_matrix(0, 4), Catch::Contains("names no packed matrix"));
  const index_t T = 9;
  const auto x = reference::random_tokens(T, H, 4);
  std::vector<float> yb(x.size(), std::numeric_limits<float>::quiet_NaN()), yc = yb;
  b.forward({x.data(), T, H}, {yb.data(), T, H});
  c.forward({x.data(), T, H}, {yc.data(), T, H});
  for (std::size_t i = 0; i < yb.size(); ++i) {
    CHECK(std::isfinite(yb[i]));
    CHECK(yb[i] == yc[i]);
  }
}

TEST_CASE("int4 layer: act-order matrices (GPTQ desc_act) compute with their inputs gathered") {
  // Layer B is given, through refill_packed, every matrix of weights v quantised in an input
  // order of its own (column j of the copy is input order[j]); layer C holds the values B's
  // copies unpack to (each weight in its own order) and computes in fp32. They agree to fp32
  // sums on W4A16, within the token's int8 rounding on W4A8; without the orders they do not.
  const layer_config cfg{.hidden = 64, .ffn = 96, .experts = 4, .top_k = 2, .max_tokens = 9};
  const auto w = reference::full_weights::random(cfg, 3);
  const auto v = reference::full_weights::random(cfg, 4);
  const auto mine = reference::slice(w, placement::block(cfg), 0);
  const auto theirs = reference::slice(v, placement::block(cfg), 0);
  const weights_format f = weights_format::int4_asym_g32;
  const index_t H = cfg.hidden, F = cfg.ffn, T = 9;
  const std::vector<float>* given[] = {&theirs.w1, &theirs.w3, &theirs.w2};
  const auto x = reference::random_tokens(T, H, 5);
  std::vector<float> values[3];
  const auto run = [&](bool ordered) {
    using L = moe_layer<default_policies>;
    L b(cfg, comm::local{}, {w.gate_view(), mine.experts(), w.shared()});
    b.pack_weights(f);
    int filled = 0;
    for (int t = 0; t < 3; ++t) {
      const index_t rows = t == 2 ? H : F, cols = t == 2 ? F : H;
      values[t].assign(std::size_t(cfg.experts * rows * cols), 0.f);
      for (index_t j = 0; j < cfg.experts; ++j) {
        std::vector<index_t> order(static_cast<std::size_t>(cols));
        for (index_t k = 0; k < cols; ++k) order[std::size_t(k)] = (k * 37 + 11 * j + t) % cols;
        std::vector<float> permuted(std::size_t(rows * cols));  // columns in that order
        const float* src = given[t]->data() + j * rows * cols;
        for (index_t n = 0; n < rows; ++n)
          for (index_t k = 0; k < cols; ++k)
            permuted[std::size_t(n * cols + k)] = src[n * cols + order[std::size_t(k)]];
        const auto q = reference::group_weights::quantise({permuted.data(), rows, cols}, f);
        b.refill_packed(t, j, [&](space::packed_nt& m) {
          m.repack_grouped(f, {q.q.data(), rows, cols}, q.scale.data(), q.offset.data());
          if (ordered) m.set_input_order(order);
        });
        b.packed_matrix(t, j).unpack(values[t].data() + j * rows * cols);
        ++filled;
      }
    }
    CHECK(filled == 3 * cfg.experts);
    std::vector<float> y(x.size(), std::numeric_limits<float>::quiet_NaN());
    b.forward({x.data(), T, H}, {y.data(), T, H});
    return y;
  };
  const std::vector<float> yb = run(true);
  const stacked_view<const float> vw1{values[0].data(), cfg.experts, F, H},
      vw3{values[1].data(), cfg.experts, F, H}, vw2{values[2].data(), cfg.experts, H, F};
  moe_layer<default_policies> c(cfg, comm::local{}, {w.gate_view(), {vw1, vw3, vw2}, w.shared()});
  std::vector<float> yc(x.size(), std::numeric_limits<float>::quiet_NaN());
  c.forward({x.data(), T, H}, {yc.data(), T, H});
  const bool a8 = space::int8_kernel_for(space::best_cpu_path()) == space::int8_kernel::avx512_vnni;
  const double tol = a8 ? 3 * std::sqrt(6.0) * token_rounding(F) : 1e-5;
  INFO("act order: " << space::name_of(space::int8_kernel_for(space::best_cpu_path()), f)
                     << " error " << rms_error(yb, yc) << " tolerance " << tol);
  CHECK(rms_error(yb, yc) <= tol);
  CHECK(rms_error(run(false), yc) > 3 * tol);  // the control: the orders matter
}
