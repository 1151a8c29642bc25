// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// Codes only (issue 37): a layer serving a quantised checkpoint keeps the packed codes and no
// float copy of its experts. Its views are space::unbacked_tensors' (address space, no memory;
// a read faults); moe_layer::pack_codes loads every matrix. The outputs equal a layer whose
// views hold the values, loaded with the same codes, on 1, 2 and 4 thread ranks and in every
// format; what would read the views is refused by name.
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <limits>
#include <vector>

#include "harness.hpp"
#include <epmoe/reference/quantised.hpp>

using namespace epmoe;

namespace {

struct codes_policies : default_policies {
  using router = epmoe::router::topk_softmax<2>;
  using comm = epmoe::comm::threads;
};

// The resident set of this process, in bytes (Linux: /proc/self/statm's second field).
long resident_bytes() {
  long pages = 0, resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = -1;
    std::fclose(f);
  }
  return resident * ::sysconf(_SC_PAGESIZE);
}

// Whether reading *p in a child process ends it abnormally (a fault; under ASan, its report).
bool read_faults(const float* p) {
  const pid_t child = ::fork();
  if (child == 0) {
    std::signal(SIGSEGV, SIG_DFL);  // (not Catch's or ASan's handler: the child just ends)
    std::signal(SIGBUS, SIG_DFL);
    volatile float v = *p;
    (void)v;
    ::_exit(0);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  return !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

// The matrices of a rank's expert tensors (routed w1, w3, w2, then the shared ones), the
// values the codes are made from.
struct matrices {
  std::vector<const std::vector<float>*> values;
  std::vector<index_t> count, rows, cols;
  matrix_view<const float> at(std::size_t t, index_t j) const {
    return {values[t]->data() + j * rows[t] * cols[t], rows[t], cols[t]};
  }
};

// A checkpoint's loader: matrix j of tensor t quantised by the format's reference quantiser
// and loaded as codes (repack_fp8, repack_mxfp4, repack_int8, repack_grouped); `shift` loads
// slot (j + shift) mod count instead (a control: other codes).
auto loader(const weights_format& f, const matrices& m, int* loads, index_t shift = 0) {
  return [&f, &m, loads, shift](std::size_t t, index_t j, space::packed_nt& out) {
    const matrix_view<const float> w = m.at(t, (j + shift) % m.count[t]);
    if (f == weights_format::fp8_block) {
      const auto q = reference::fp8_block::quantise(w);
      out.repack_fp8({q.q.data(), w.rows, w.cols}, q.scale.data());
    } else if (f == weights_format::mxfp4) {
      const auto q = reference::mxfp4::quantise(w);
      const auto blocks = q.packed_blocks();
      out.repack_mxfp4(w.cols, {blocks.data(), w.rows, q.blocks() * 16},
                       {q.scale.data(), w.rows, q.blocks()});
    } else if (f == weights_format::int8_channel) {
      const auto q = reference::int8_channel::quantise(w);
      out.repack_int8({q.q.data(), w.rows, w.cols}, q.scale.data());
    } else {
      const auto q = reference::group_weights::quantise(w, f);
      out.repack_grouped(f, {q.q.data(), w.rows, w.cols}, q.scale.data(),
                         f.id == weights_format::kind::int4_asym ? q.offset.data() : nullptr);
    }
    ++*loads;
    return true;
  };
}

const weights_format* const formats[] = {&weights_format::fp8_block, &weights_format::mxfp4,
                                         &weights_format::int8_channel, &weights_format::int4_g32,
                                         &weights_format::int4_asym_g128};

}  // namespace

TEST_CASE("unbacked_tensors: views with shapes and no memory, whose reads fault") {
  const long before = resident_bytes();
  REQUIRE(before > 0);
  space::unbacked_tensors none;
  // DeepSeek-V3's routed experts of one layer: 256 x 3 matrices of 2048 x 7168 (44 GiB).
  const stacked_view<const float> w1 = none.add(256, 2048, 7168);
  const stacked_view<const float> w2 = none.add(256, 7168, 2048);
  CHECK(none.reserved_bytes() == std::size_t(2) * 256 * 2048 * 7168 * sizeof(float));
  CHECK((w1.count == 256 && w1.rows == 2048 && w1.cols == 7168 && w1.stride == 7168));
  CHECK(w2.batch_stride == 7168 * 2048);
  CHECK((w1.data + w1.count * w1.batch_stride <= w2.data ||
         w2.data + w2.count * w2.batch_stride <= w1.data));  // apart
  CHECK(resident_bytes() - before < (4L << 20));             // no memory behind 28 GiB
  CHECK(read_faults(w1.data));
  CHECK(read_faults(w2[255].data + 7168 * 2048 - 1));
  const float backed = 1;
  CHECK_FALSE(read_faults(&backed));  // the control: the child can tell
  CHECK_THROWS_WITH(none.add(0, 2, 2), Catch::Contains("unbacked_tensors.add"));
}

TEST_CASE("codes only: the layer of unbacked views equals the one holding values, every format") {
  int runs = 0;
  for (const weights_format* f : formats)
    for (int R : {1, 2, 4}) {
      CAPTURE(f->name(), R);
      const layer_config cfg{.hidden = 160,  // past a block of 128 (fp8) and of 32
                             .ffn = 72,
                             .experts = 8,
                             .top_k = 2,
                             .ranks = R,
                             .max_tokens = 9,
                             .shared_experts = 1,
                             .shared_ffn = 40};
      const index_t H = cfg.hidden, F = cfg.ffn, L = cfg.experts / R, Fs = cfg.shared_ffn;
      const auto w = reference::full_weights::random(cfg, 11 + R);
      const auto g = test::make_tokens(std::vector<index_t>(R, 9), H, 3 + R);
      std::vector<float> with_values(g.x.size()), codes(g.x.size()), other(g.x.size());
      std::vector<int> loads(R, 0);
      comm::threads_world world(R);
      world.run([&](comm::threads c) {
        const int r = c.rank();
        const placement::block where(cfg);
        const auto mine = reference::slice(w, where, r);
        const matrices m{{&mine.w1, &mine.w3, &mine.w2, &w.shared_w1, &w.shared_w3, &w.shared_w2},
                         {L, L, L, 1, 1, 1},
                         {F, F, H, Fs, Fs, H},
                         {H, H, F, H, H, Fs}};
        test::rank_arrays<codes_policies> arrays(w, mine);
        const auto views = arrays.views(cfg, L);
        const index_t T = g.per_rank[r];
        const auto x = std::span(g.x).subspan(g.offset(r) * H, T * H);
        const auto run = [&](moe_layer<codes_policies>& layer, std::vector<float>& out) {
          std::vector<float> y(x.size(), std::numeric_limits<float>::quiet_NaN());
          layer.forward({x.data(), T, H}, {y.data(), T, H});
          std::copy(y.begin(), y.end(), out.begin() + g.offset(r) * H);
        };
        {
          moe_layer<codes_policies> layer(cfg, c, views);
          layer.pack_weights(*f, loader(*f, m, &loads[r]));
          run(layer, with_values);
        }
        space::unbacked_tensors none;  // (outlives the layer reading its views)
        auto unbacked = views;
        unbacked.experts = {none.add(L, F, H), none.add(L, F, H), none.add(L, H, F)};
        unbacked.shared = {none.add(1, Fs, H), none.add(1, Fs, H), none.add(1, H, Fs)};
        moe_layer<codes_policies> layer(cfg, c, unbacked);
        layer.pack_codes(*f, loader(*f, m, &loads[r]));
        CHECK_FALSE(layer.weights_hold_values());
        run(layer, codes);
        layer.pack_codes(*f, loader(*f, m, &loads[r], 1));  // other codes: the check can fail
        run(layer, other);
      });
      for (int n : loads) CHECK(n == 3 * 3 * (L + 1));  // 3 loads of 3L + 3 matrices
      for (std::size_t i = 0; i < codes.size(); ++i) REQUIRE(std::isfinite(codes[i]));
      CHECK(codes == with_values);  // bit for bit: the same packed codes, the same kernels
      CHECK(test::relative_error(other, with_values) > 1e-2);
      ++runs;
    }
  CHECK(runs == 15);
}

TEST_CASE("codes only: what would read the views is refused, a failed load stops the passes") {
  layer_config cfg{.hidden = 40, .ffn = 24, .experts = 4, .top_k = 2, .max_tokens = 5};
  cfg.training = true;
  const index_t H = cfg.hidden, F = cfg.ffn, E = cfg.experts, T = 5;
  const auto w = reference::full_weights::random(cfg, 5);
  const auto mine = reference::slice(w, placement::block(cfg), 0);
  const matrices m{{&mine.w1, &mine.w3, &mine.w2}, {E, E, E}, {F, F, H}, {H, H, F}};
  space::unbacked_tensors none;
  const expert::swiglu::weights unbacked{none.add(E, F, H), none.add(E, F, H), none.add(E, H, F)};
  moe_layer<default_policies> layer(cfg, comm::local{}, {w.gate_view(), unbacked});
  const auto x = reference::random_tokens(T, H, 4);
  std::vector<float> y(x.size());
  const auto forward = [&] {
    std::fill(y.begin(), y.end(), std::numeric_limits<float>::quiet_NaN());
    layer.forward({x.data(), T, H}, {y.data(), T, H});
  };
  int loads = 0;
  const weights_format& f = weights_format::int4_g32;
  // A loader that skips a matrix: refused before that matrix is read from the views.
  CHECK_THROWS_WITH(layer.pack_codes(f,
                                     [&](std::size_t t, index_t j, space::packed_nt& out) {
                                       return t == 1 && j == 2 ? false
                                                               : loader(f, m, &loads)(t, j, out);
                                     }),
                    Catch::Contains("pack_codes") && Catch::Contains("tensor 1, slot 2") &&
                        Catch::Contains("not loaded"));
  CHECK_THROWS_WITH(forward(), Catch::Contains("pack_codes") && Catch::Contains("threw"));
  for (float v : y) CHECK(std::isnan(v));  // nothing written
  layer.pack_codes(f, loader(f, m, &loads));
  forward();
  for (float v : y) CHECK(std::isfinite(v));
  const std::vector<float> want = y;
  const auto refused = [](auto&& call, const char* what) {
    CHECK_THROWS_WITH(call(), Catch::Contains(what) && Catch::Contains("codes only"));
  };
  refused([&] { layer.pack_weights(); }, "pack_weights");
  refused([&] { layer.pack_weights(weights_format::fp32); }, "pack_weights");
  refused([&] { layer.unpack_weights(); }, "unpack_weights");
  refused(
      [&] { layer.pack_weights(f, [](std::size_t, index_t, space::packed_nt&) { return false; }); },
      "pack_codes");
  std::vector<float> dy(x.size(), 0.5f), dx(x.size(), std::numeric_limits<float>::quiet_NaN());
  std::vector<float> g0(std::size_t(E * H)), g1(std::size_t(E * F * H)), g3(g1.size()),
      g2(g1.size());
  moe_layer<default_policies>::gradients grads;
  grads.gate = {g0.data(), E, H};
  grads.experts = {{g1.data(), E, F, H}, {g3.data(), E, F, H}, {g2.data(), E, H, F}};
  refused([&] { layer.backward({dy.data(), T, H}, {dx.data(), T, H}, grads); }, "backward");
  for (float v : dx) CHECK(std::isnan(v));
  CHECK(layer.weights_packed());  // every refusal left the codes in place
  forward();
  CHECK(y == want);
  // Another gate beside the same expert views (a framework that moved its router): still
  // codes only, nothing read from the views.
  const std::vector<float> gate(w.gate);
  layer.set_weights({{gate.data(), E, H}, unbacked});
  CHECK_FALSE(layer.weights_hold_values());
  forward();
  CHECK(y == want);
  // Views that hold values end it: packed again from them (the format's quantisation).
  layer.set_weights({w.gate_view(), mine.experts()});
  CHECK(layer.weights_hold_values());
  forward();
  CHECK(y == want);  // the reference quantiser is the packer's: the same codes
  layer.unpack_weights();
  forward();
  CHECK(test::relative_error(y, want) > 1e-3);  // fp32 now
  CHECK(loads == 6 + 3 * E);                    // the failed load's first six, then all
}
