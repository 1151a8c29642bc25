// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// llama.cpp's MoE FFN on ggml's CPU backend (the ggml that PyPI llama-cpp-python vendors),
// the graph llama.cpp's build_moe_ffn makes for a decode step: up and gate by MUL_MAT_ID
// (the activations [H, 1, T] broadcast over the k used experts), silu(gate) * up
// (swiglu_split), down by MUL_MAT_ID, times the router weights, summed over k. The experts'
// weights sit in the buffer type llama.cpp would pick for them: the CPU "repack" buffer where
// it takes the op (Q4_0, Q4_K, Q8_0, MXFP4 interleaved for AVX2/AVX-512 GEMV/GEMM), else the
// plain CPU buffer. One JSON line per point on stdout; anchors.py runs it.
//
//   ggml_moe --shape H,F,E,k [--tokens 1,16,128] [--formats bf16,q8_0,q4_0,q4_k,mxfp4]
//            [--reps N] [--threads 2] [--flush-mb 512]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

namespace {

std::vector<long> parse(const std::string& s) {
  std::vector<long> out;
  for (std::size_t at = 0; at < s.size();) {
    const std::size_t c = std::min(s.find(',', at), s.size());
    out.push_back(std::stol(s.substr(at, c - at)));
    at = c + 1;
  }
  return out;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  for (std::size_t at = 0; at < s.size();) {
    const std::size_t c = std::min(s.find(',', at), s.size());
    out.push_back(s.substr(at, c - at));
    at = c + 1;
  }
  return out;
}

ggml_type type_of(const std::string& f) {
  if (f == "bf16") return GGML_TYPE_BF16;
  if (f == "q8_0") return GGML_TYPE_Q8_0;
  if (f == "q4_0") return GGML_TYPE_Q4_0;
  if (f == "q4_k") return GGML_TYPE_Q4_K;
  if (f == "mxfp4") return GGML_TYPE_MXFP4;
  std::fprintf(stderr, "unknown format %s\n", f.c_str());
  std::exit(2);
}

// The first extra buffer type (repack) that takes MUL_MAT_ID over w, as llama.cpp's loader
// picks it (weight_buft_supported), else the CPU buffer type.
ggml_backend_buffer_type_t pick_buft(ggml_backend_dev_t dev, ggml_tensor* w, int k) {
  auto* reg = ggml_backend_dev_backend_reg(dev);
  auto get = (ggml_backend_dev_get_extra_bufts_t)ggml_backend_reg_get_proc_address(
      reg, "ggml_backend_dev_get_extra_bufts");
  if (get) {
    ggml_init_params p{16 * ggml_tensor_overhead(), nullptr, true};
    ggml_context* tmp = ggml_init(p);
    ggml_tensor* b = ggml_new_tensor_3d(tmp, GGML_TYPE_F32, w->ne[0], k, 1);
    ggml_tensor* ids = ggml_new_tensor_2d(tmp, GGML_TYPE_I32, k, 1);
    ggml_tensor* op = ggml_mul_mat_id(tmp, w, b, ids);
    for (ggml_backend_buffer_type_t* t = get(dev); t && *t; ++t) {
      ggml_backend_buffer_t dummy = ggml_backend_buft_alloc_buffer(*t, 0);
      w->buffer = dummy;
      const bool ok = ggml_backend_dev_supports_op(dev, op);
      w->buffer = nullptr;
      ggml_backend_buffer_free(dummy);
      if (ok) {
        ggml_free(tmp);
        return *t;
      }
    }
    ggml_free(tmp);
  }
  return ggml_backend_cpu_buffer_type();
}

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

int main(int argc, char** argv) {
  std::string shape = "4096,1792,8,2", tokens_s = "1,16,128",
              formats_s = "bf16,q8_0,q4_0,q4_k,mxfp4";
  int reps = 7, threads = 2, flush_mb = 512;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--shape")
      shape = v;
    else if (a == "--tokens")
      tokens_s = v;
    else if (a == "--formats")
      formats_s = v;
    else if (a == "--reps")
      reps = std::stoi(v);
    else if (a == "--threads")
      threads = std::stoi(v);
    else if (a == "--flush-mb")
      flush_mb = std::stoi(v);
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  const auto sh = parse(shape);
  const long H = sh[0], F = sh[1], E = sh[2], k = sh[3];
  const auto tokens = parse(tokens_s);
  const long T_max = *std::max_element(tokens.begin(), tokens.end());

  ggml_backend_t backend = ggml_backend_cpu_init();
  ggml_backend_cpu_set_n_threads(backend, threads);
  ggml_backend_dev_t dev = ggml_backend_get_device(backend);
  std::vector<float> flush(std::size_t(flush_mb) << 18, 1.f);
  volatile float sink = 0;

  // fp32 weights once (the same distribution as epmoe_bench_quant's), quantised per format.
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> w13(std::size_t(2 * E * F * H)), w2(std::size_t(E * H * F));
  for (float& v : w13) v = u(rng) / std::sqrt(float(H));
  for (float& v : w2) v = u(rng) / std::sqrt(float(F));

  for (const std::string& fmt : split(formats_s)) {
    const ggml_type type = type_of(fmt);
    ggml_init_params wp{4 * ggml_tensor_overhead(), nullptr, true};
    ggml_context* wctx = ggml_init(wp);
    ggml_tensor* gate = ggml_new_tensor_3d(wctx, type, H, F, E);
    ggml_tensor* up = ggml_new_tensor_3d(wctx, type, H, F, E);
    ggml_tensor* down = ggml_new_tensor_3d(wctx, type, F, H, E);
    ggml_backend_buffer_type_t buft = pick_buft(dev, gate, int(k));
    ggml_backend_buffer_t wbuf = ggml_backend_alloc_ctx_tensors_from_buft(wctx, buft);
    ggml_backend_buffer_set_usage(wbuf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    const float* src[3] = {w13.data(), w13.data() + E * F * H, w2.data()};
    ggml_tensor* dst[3] = {gate, up, down};
    for (int m = 0; m < 3; ++m) {
      const long rows = dst[m]->ne[1] * E, cols = dst[m]->ne[0];
      std::vector<char> q(ggml_nbytes(dst[m]));
      ggml_quantize_chunk(type, src[m], q.data(), 0, rows, cols, nullptr);
      ggml_backend_tensor_set(dst[m], q.data(), 0, q.size());  // repacks where buft does
    }
    const double per_expert = double(ggml_nbytes(gate) + ggml_nbytes(up) + ggml_nbytes(down)) / E;

    for (long T : tokens) {
      ggml_init_params gp{256 * ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, true};
      ggml_context* g = ggml_init(gp);
      ggml_tensor* x = ggml_new_tensor_3d(g, GGML_TYPE_F32, H, 1, T);
      ggml_tensor* ids = ggml_new_tensor_2d(g, GGML_TYPE_I32, k, T);
      ggml_tensor* rw = ggml_new_tensor_3d(g, GGML_TYPE_F32, 1, k, T);
      ggml_tensor* u_ = ggml_mul_mat_id(g, up, x, ids);    // [F, k, T]
      ggml_tensor* g_ = ggml_mul_mat_id(g, gate, x, ids);  // [F, k, T]
      ggml_tensor* a = ggml_swiglu_split(g, g_, u_);
      ggml_tensor* d = ggml_mul(g, ggml_mul_mat_id(g, down, a, ids), rw);  // [H, k, T]
      ggml_tensor* y = ggml_view_2d(g, d, H, T, d->nb[2], 0);
      for (long j = 1; j < k; ++j)
        y = ggml_add(g, y, ggml_view_2d(g, d, H, T, d->nb[2], j * d->nb[1]));
      ggml_cgraph* gf = ggml_new_graph(g);
      ggml_build_forward_expand(gf, y);
      ggml_gallocr_t alloc = ggml_gallocr_new(ggml_backend_cpu_buffer_type());
      ggml_gallocr_alloc_graph(alloc, gf);

      std::mt19937_64 r(11 + T);
      std::vector<int> id(std::size_t(k * T)), perm(static_cast<std::size_t>(E));
      std::vector<char> used(static_cast<std::size_t>(E), 0);
      for (long t = 0; t < T; ++t) {
        for (long e = 0; e < E; ++e) perm[std::size_t(e)] = int(e);
        std::shuffle(perm.begin(), perm.end(), r);
        for (long j = 0; j < k; ++j) {
          id[std::size_t(t * k + j)] = perm[std::size_t(j)];
          used[std::size_t(perm[std::size_t(j)])] = 1;
        }
      }
      std::vector<float> xs(std::size_t(H * T)), ws(std::size_t(k * T), 1.f / float(k));
      for (float& v : xs) v = u(rng);
      ggml_backend_tensor_set(x, xs.data(), 0, ggml_nbytes(x));
      ggml_backend_tensor_set(ids, id.data(), 0, ggml_nbytes(ids));
      ggml_backend_tensor_set(rw, ws.data(), 0, ggml_nbytes(rw));
      std::vector<double> times;
      for (int rep = 0; rep < reps + 2; ++rep) {
        float s = 0;
        for (std::size_t i = 0; i < flush.size(); i += 16) s += flush[i];
        sink = sink + s;
        const double t0 = now();
        ggml_backend_graph_compute(backend, gf);
        if (rep >= 2) times.push_back(now() - t0);
      }
      std::vector<float> out(std::size_t(H * T));
      ggml_backend_tensor_get(y, out.data(), 0, out.size() * sizeof(float));
      bool finite = true;
      for (float v : out) finite = finite && std::isfinite(v);
      std::sort(times.begin(), times.end());
      long active = 0;
      for (char c : used) active += c;
      std::printf(
          "{\"engine\": \"llama.cpp\", \"format\": \"%s\", \"T\": %ld, \"ms\": %.4f, \"bytes\": "
          "%.0f, "
          "\"active\": %ld, \"finite\": %s, \"path\": \"ggml MUL_MAT_ID, %s weights in buffer %s, "
          "%d threads\"}\n",
          fmt.c_str(), T, 1e3 * times[times.size() / 2], per_expert * double(active), active,
          finite ? "true" : "false", ggml_type_name(gate->type), ggml_backend_buft_name(buft),
          threads);
      std::fflush(stdout);
      ggml_gallocr_free(alloc);
      ggml_free(g);
    }
    ggml_backend_buffer_free(wbuf);
    ggml_free(wctx);
  }
  ggml_backend_free(backend);
  (void)T_max;
  return 0;
}
