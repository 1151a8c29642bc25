// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// The experts stage over packed weights in each format, side by side in one run (issue 37):
// int8_channel against bf16 and fp32 copies of the same experts, SwiGLU (expert::swiglu::
// forward on the host space: the layer's grouped GEMMs), T tokens routed top-k uniformly at
// random. Prints the time per pass (the three formats back to back in every rep), the ratios,
// and the bytes roofline: the packed bytes (weights + scales) of the experts the pass
// activates / the read bandwidth (the faster of the run's start and a read beside the point),
// and the share of it each format reaches; and the compute roofline of each format's own dot
// product (peak_rates.hpp: T k 3 H F multiply-adds at the rate this CPU retires it, measured at
// the start on every thread) and its share. Weights come from memory before every timed pass
// (a 64 MB read evicts the caches).
//
// Then the group-wise formats (int4, int4_asym groups 32 and 128, int8_g32) against bf16 in a
// table of their own (group_table; --group: that table only; its last row, "_ao", int4_asym_g128
// with an act order on every matrix), and bf16 against fp8_block and
// mxfp4 copies the same way (minifloat_table; --minifloat: that table only).
//
//   epmoe_bench_quant [--shapes mixtral,deepseek] [--tokens 1,16,128,1024] [--reps N]
//                     [--read-gbs X] [--flush-mb N] [--group] [--minifloat] [--smoke]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "peak_rates.hpp"
#include <epmoe/expert/swiglu.hpp>
#include <epmoe/space/host.hpp>
#include <epmoe/space/host_int4.hpp>

using epmoe::index_t;
using epmoe::weights_format;
namespace sp = epmoe::space;

namespace {

struct shape {
  const char* name;
  const char* note;
  index_t H, F, E, k;
};

// Mixtral 8x7B: H 4096, F 14336, 8 experts, top-2 (F an eighth: all 8 experts' fp32 weights
// and one packed copy in 1.4 GB). DeepSeek-V3: H 7168, F 2048, 256 experts, top-8 (F half,
// 16 experts).
const shape shapes[] = {
    {"mixtral", "Mixtral-like H 4096, F 1792 (14336 / 8), E 8, top-2", 4096, 1792, 8, 2},
    {"deepseek", "DeepSeek-like H 7168, F 1024 (2048 / 2), E 16 (256 / 16), top-8", 7168, 1024, 16,
     8},
    {"tiny", "tiny H 256, F 128, E 4, top-2 (smoke)", 256, 128, 4, 2},
};

std::vector<index_t> parse_list(const std::string& s) {
  std::vector<index_t> out;
  for (std::size_t at = 0; at < s.size();) {
    const std::size_t comma = std::min(s.find(',', at), s.size());
    out.push_back(std::stoll(s.substr(at, comma - at)));
    at = comma + 1;
  }
  return out;
}

// T tokens routed to k distinct experts each, uniformly: rows per expert (expert-major).
std::vector<index_t> route(index_t T, index_t E, index_t k, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<index_t> rows(static_cast<std::size_t>(E), 0), ids(static_cast<std::size_t>(E));
  for (index_t t = 0; t < T; ++t) {
    for (index_t e = 0; e < E; ++e) ids[std::size_t(e)] = e;
    for (index_t j = 0; j < k; ++j) {
      std::uniform_int_distribution<index_t> pick(j, E - 1);
      std::swap(ids[std::size_t(j)], ids[std::size_t(pick(rng))]);
      ++rows[std::size_t(ids[std::size_t(j)])];
    }
  }
  return rows;
}

// --flush-mb: one eviction read for every table (0: each table's own, 64 or 512 MB), so that
// bench/anchors/anchors.py evicts epmoe's caches as it evicts the anchors'.
std::size_t flush_mb = 0;

std::size_t flush_floats(std::size_t default_mb) {
  return (flush_mb ? flush_mb : default_mb) << 18;
}

struct point {
  index_t T = 0, active = 0;
  double seconds[3] = {};  // fp32, bf16, int8
  double bytes[3] = {};    // packed bytes of the active experts
  double gbs = 0;          // read bandwidth measured right after the point
};

// Rows per expert for a point, as offsets (expert-major).
std::vector<index_t> offsets_of(const std::vector<index_t>& rows) {
  std::vector<index_t> offsets(rows.size() + 1, 0);
  for (std::size_t e = 0; e < rows.size(); ++e) offsets[e + 1] = offsets[e] + rows[e];
  return offsets;
}

// The dot product format f's kernel runs on `path` (its compute roofline's instruction).
bench::dot dot_of(weights_format f, sp::cpu_path path) {
  if (f == weights_format::int8_channel || f.grouped() ||
      (f == weights_format::mxfp4 && sp::mxfp4_w4a8(path)))
    return sp::int8_kernel_for(path) == sp::int8_kernel::avx512_vnni ? bench::dot::vnni
                                                                     : bench::dot::fp32_fma;
  if (f == weights_format::bf16)
    return path == sp::cpu_path::avx512_bf16 ? bench::dot::bf16 : bench::dot::fp32_fma;
  if (sp::is_minifloat(f) && sp::minifloat_kernel_for(path) == sp::minifloat_kernel::avx512_bf16)
    return bench::dot::bf16;
  return bench::dot::fp32_fma;
}

// The group-wise formats against bf16: per point, the formats back to back in every rep
// (caches evicted before each pass: a 512 MB read), the time, the ratio to bf16 and the share of
// the bytes roofline (the active experts' weights + scales + offsets / the faster of `gbs` and a
// read beside the point). Returns false on a non-finite output.
bool group_table(const shape& s, const epmoe::expert::swiglu::weights& w,
                 const std::vector<index_t>& tokens, int reps, const sp::host& space0, double gbs,
                 int streams, bool prefetch, double given_gbs, int cpus,
                 const bench::peaks& peaks) {
  // The last entry: int4_asym_g128 with an act order (GPTQ's desc_act) on every matrix, whose
  // products gather their inputs first (packed_nt::set_input_order).
  const weights_format formats[] = {weights_format::bf16,           weights_format::int4_g32,
                                    weights_format::int4_g128,      weights_format::int4_asym_g32,
                                    weights_format::int4_asym_g128, weights_format::int8_g32,
                                    weights_format::int4_asym_g128};
  constexpr int nf = std::size(formats);
  const auto act_order = [&](int f) { return f == nf - 1; };
  const index_t H = s.H, F = s.F, E = s.E;
  const sp::int8_kernel kernel = sp::int8_kernel_for(space0.kernel_path());
  index_t max_rows = 0;
  for (index_t T : tokens) max_rows = std::max(max_rows, T * s.k);
  std::vector<float> x0(std::size_t(max_rows * H)), x(x0.size()),
      scratch(std::size_t(max_rows * epmoe::expert::swiglu::scratch_per_row(F)));
  std::mt19937_64 rng(9);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (float& v : x0) v = u(rng);
  // 512 MB: more than the 480 MB L3 this VM reports (64 MB left a 27 MB int4 pass partly in
  // the L3: over 100% of the roof in one run).
  std::vector<float> flush_buffer(flush_floats(512), 1.f);
  volatile float sink = 0;
  std::vector<sp::packed_weights> packed(nf);
  std::vector<sp::host> spaces(nf, space0);
  double per_expert[nf];
  for (int f = 0; f < nf; ++f) {
    for (auto v : {w.w1, w.w3, w.w2}) {
      packed[f].pack(v, formats[f]);
      if (!act_order(f)) continue;
      std::vector<index_t> order(static_cast<std::size_t>(v.cols));
      for (std::size_t k = 0; k < order.size(); ++k) order[k] = index_t(k);
      sp::packed_nt* m = packed[f].find(v);
      for (index_t j = 0; j < v.count; ++j) {
        std::shuffle(order.begin(), order.end(), rng);
        m[j].set_input_order(order);
      }
    }
    packed[f].reserve_inputs(max_rows, space0.kernel_path());
    spaces[f].use_packed(&packed[f]);
    per_expert[f] = double(packed[f].bytes()) / double(E);
  }
  std::printf("%s: group-wise formats, %s (int8_g32: %s)\n", s.note,
              sp::name_of(kernel, weights_format::int4_g32),
              sp::name_of(kernel, weights_format::int8_g32));
  std::printf("%6s %6s %6s | %-15s %9s %8s %8s %9s %6s | %8s %6s\n", "T", "active", "GB/s",
              "format", "ms", "x bf16", "MB", "roof ms", "%roof", "comp ms", "%comp");
  for (index_t T : tokens) {
    const auto rows = route(T, E, s.k, 11 + T);
    index_t active = 0;
    for (index_t n : rows) active += n > 0;
    std::vector<index_t> offsets = offsets_of(rows);
    const index_t n = offsets.back();
    const epmoe::grouped_rows<float> g{x.data(),      H, H, static_cast<int>(E), offsets.data(),
                                       offsets.data()};
    std::vector<std::vector<double>> t(nf);
    for (int r = 0; r < reps + 1; ++r)
      for (int f = 0; f < nf; ++f) {
        std::memcpy(x.data(), x0.data(), std::size_t(n * H) * sizeof(float));
        float sum = 0;
        for (std::size_t i = 0; i < flush_buffer.size(); i += 16) sum += flush_buffer[i];
        sink = sink + sum;
        const auto start = bench::clock::now();
        epmoe::expert::swiglu::forward(spaces[f], w, g, scratch.data());
        if (r > 0) t[f].push_back(bench::seconds_since(start));
        for (index_t i = 0; i < n * H; ++i)
          if (!std::isfinite(x[std::size_t(i)])) {
            std::fprintf(stderr, "%s %s T=%lld: a non-finite output\n", s.name, formats[f].name(),
                         static_cast<long long>(T));
            return false;
          }
      }
    const double here =
        given_gbs > 0 ? given_gbs
                      : bench::read_bandwidth(std::size_t(std::max(per_expert[0] * active, 64e6)),
                                              cpus, streams, prefetch);
    double ms[nf];
    for (int f = 0; f < nf; ++f) {
      std::sort(t[f].begin(), t[f].end());
      ms[f] = 1e3 * t[f][t[f].size() / 2];
    }
    for (int f = 0; f < nf; ++f) {
      const double bytes = per_expert[f] * double(active);
      const double roof = 1e3 * bytes / (std::max(here, gbs) * 1e9);
      const std::string label =
          std::string(formats[f].name()) +
          (formats[f].grouped() ? "_g" + std::to_string(formats[f].group) : "") +
          (act_order(f) ? "_ao" : "");
      const double comp =
          peaks.floor_ms(dot_of(formats[f], space0.kernel_path()), double(n) * 3 * H * F);
      std::printf("%6lld %6lld %6.1f | %-15s %9.3f %7.2fx %8.1f %9.3f %5.0f%% | %8.3f %5.0f%%\n",
                  static_cast<long long>(T), static_cast<long long>(active), here, label.c_str(),
                  ms[f], ms[0] / ms[f], bytes / 1e6, roof, 100 * roof / ms[f], comp,
                  100 * comp / ms[f]);
    }
  }
  std::printf("\n");
  return true;
}

// bf16 against fp8_block and mxfp4 copies of the experts w (shape s), back to back in every
// rep, caches evicted before each pass; the bytes roofline as main's (read: the bandwidth
// at the start, or beside each point when it is faster, measured the same way).
void minifloat_table(const shape& s, const epmoe::expert::swiglu::weights& w,
                     const std::vector<index_t>& tokens, int reps, double start_gbs,
                     double given_gbs, int streams, bool prefetch, const bench::peaks& peaks) {
  const index_t H = s.H, F = s.F, E = s.E;
  constexpr int n_formats = 3;
  const weights_format formats[n_formats] = {weights_format::bf16, weights_format::fp8_block,
                                             weights_format::mxfp4};
  const sp::host space0{};
  const int cpus = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  index_t max_rows = 0;
  for (index_t T : tokens) max_rows = std::max(max_rows, T * s.k);
  sp::packed_weights packed[n_formats];
  sp::host spaces[n_formats] = {space0, space0, space0};
  double per_expert[n_formats];
  for (int f = 0; f < n_formats; ++f) {
    for (auto v : {w.w1, w.w3, w.w2}) packed[f].pack(v, formats[f]);
    packed[f].reserve_inputs(max_rows, space0.kernel_path());
    spaces[f].use_packed(&packed[f]);
    per_expert[f] = double(packed[f].bytes()) / double(E);
  }
  std::vector<float> x0(std::size_t(max_rows * H)), x(x0.size()),
      scratch(std::size_t(max_rows * epmoe::expert::swiglu::scratch_per_row(F)));
  std::mt19937_64 rng(9);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (float& v : x0) v = u(rng);
  std::vector<float> flush_buffer(flush_floats(64), 1.f);
  volatile float sink = 0;
  std::printf("%s: bf16 against fp8_block and mxfp4 (kernel %s; mxfp4 %s)\n", s.note,
              sp::name_of(sp::minifloat_kernel_for(space0.kernel_path())),
              sp::mxfp4_w4a8(space0.kernel_path())
                  ? "AVX512-VNNI W4A8"
                  : sp::name_of(sp::minifloat_kernel_for(space0.kernel_path())));
  std::printf("%6s %6s %6s | %9s %9s %9s | %8s %8s | %8s %8s %8s | %6s %6s %6s | %6s %6s %6s\n",
              "T", "active", "GB/s", "bf16 ms", "fp8 ms", "mxfp4 ms", "bf16/fp8", "bf16/mx4",
              "fp8 MB", "roof8 ms", "roof4 ms", "%roof16", "%roof8", "%roof4", "%comp16", "%comp8",
              "%comp4");
  for (index_t T : tokens) {
    const auto rows = route(T, E, s.k, 11 + T);
    std::vector<index_t> offsets(std::size_t(E + 1), 0);
    index_t active = 0;
    for (index_t e = 0; e < E; ++e) {
      offsets[std::size_t(e + 1)] = offsets[std::size_t(e)] + rows[std::size_t(e)];
      active += rows[std::size_t(e)] > 0;
    }
    const index_t n = offsets.back();
    const epmoe::grouped_rows<float> g{x.data(),      H, H, static_cast<int>(E), offsets.data(),
                                       offsets.data()};
    std::vector<double> t[n_formats];
    for (int r = 0; r < reps + 1; ++r)
      for (int f = 0; f < n_formats; ++f) {
        std::memcpy(x.data(), x0.data(), std::size_t(n * H) * sizeof(float));
        float sum = 0;
        for (std::size_t i = 0; i < flush_buffer.size(); i += 16) sum += flush_buffer[i];
        sink = sink + sum;
        const auto start = bench::clock::now();
        epmoe::expert::swiglu::forward(spaces[f], w, g, scratch.data());
        if (r > 0) t[f].push_back(bench::seconds_since(start));
        for (index_t i = 0; i < n * H; ++i)
          if (!std::isfinite(x[std::size_t(i)])) {
            std::fprintf(stderr, "%s %s T=%lld: a non-finite output\n", s.name, formats[f].name(),
                         static_cast<long long>(T));
            std::exit(1);
          }
      }
    double sec[n_formats], bytes[n_formats];
    for (int f = 0; f < n_formats; ++f) {
      std::sort(t[f].begin(), t[f].end());
      sec[f] = t[f][t[f].size() / 2];
      bytes[f] = per_expert[f] * double(active);
    }
    const double gbs = given_gbs > 0 ? given_gbs
                                     : bench::read_bandwidth(std::size_t(std::max(bytes[0], 64e6)),
                                                             cpus, streams, prefetch);
    const auto roof = [&](int f) { return bytes[f] / (std::max(gbs, start_gbs) * 1e9); };
    const auto comp = [&](int f) {
      return 100 * peaks.floor_ms(dot_of(formats[f], space0.kernel_path()), double(n) * 3 * H * F) /
             (1e3 * sec[f]);
    };
    std::printf(
        "%6lld %6lld %6.1f | %9.3f %9.3f %9.3f | %7.2fx %7.2fx | %8.1f %8.3f %8.3f | %5.0f%% "
        "%5.0f%% %5.0f%% | %5.0f%% %5.0f%% %5.0f%%\n",
        static_cast<long long>(T), static_cast<long long>(active), gbs, 1e3 * sec[0], 1e3 * sec[1],
        1e3 * sec[2], sec[0] / sec[1], sec[0] / sec[2], bytes[1] / 1e6, 1e3 * roof(1),
        1e3 * roof(2), 100 * roof(0) / sec[0], 100 * roof(1) / sec[1], 100 * roof(2) / sec[2],
        comp(0), comp(1), comp(2));
  }
  std::printf("\n");
}

}  // namespace

int main(int argc, char** argv) {
  std::string shape_list = "mixtral,deepseek", token_list = "1,16,128,1024";
  int reps = 5;
  double given_gbs = 0;
  bool smoke = false, group_only = false, minifloat_only = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--shapes")
      shape_list = next();
    else if (a == "--tokens")
      token_list = next();
    else if (a == "--reps")
      reps = std::stoi(next());
    else if (a == "--read-gbs")
      given_gbs = std::stod(next());
    else if (a == "--flush-mb")
      flush_mb = std::stoul(next());
    else if (a == "--smoke")
      smoke = true;
    else if (a == "--group")
      group_only = true;
    else if (a == "--minifloat")
      minifloat_only = true;
    else {
      std::fprintf(stderr,
                   "usage: epmoe_bench_quant [--shapes mixtral,deepseek,tiny] [--tokens 1,16,...] "
                   "[--reps N] [--read-gbs X] [--flush-mb N] [--group] [--minifloat] "
                   "[--smoke]\n");
      return a == "--help" ? 0 : 2;
    }
  }
  if (smoke) shape_list = "tiny", token_list = "1,16", reps = 1;
  const std::vector<index_t> tokens = parse_list(token_list);

  const sp::host space0{};
  const sp::cpu_path path = space0.kernel_path();
  const int cpus = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  // The read configuration (streams per thread, software prefetch) that reads fastest here,
  // used again beside every point.
  struct {
    int streams = 1;
    bool prefetch = false;
    double gbs = 0;
  } probe;
  for (int streams : {1, 4})
    for (bool prefetch : {false, true}) {
      const double g = given_gbs > 0 ? given_gbs
                                     : bench::read_bandwidth(smoke ? (16u << 20) : (256u << 20),
                                                             cpus, streams, prefetch);
      if (g > probe.gbs) probe = {streams, prefetch, g};
    }
  std::printf(
      "epmoe_bench_quant: the experts stage (SwiGLU, 3 grouped GEMMs) over packed copies\n");
  std::printf("CPU: %s, %d logical CPUs; %d BLAS/helper threads\n", bench::cpu_model().c_str(),
              cpus, sp::blas_threads());
  std::printf(
      "read bandwidth: %.1f GB/s (%s, %d threads, %d stream(s) per thread%s); measured "
      "again beside every point (column GB/s)\n",
      probe.gbs, given_gbs > 0 ? "given" : "measured at the start", cpus, probe.streams,
      probe.prefetch ? ", prefetch" : "");
  const weights_format formats[3] = {weights_format::fp32, weights_format::bf16,
                                     weights_format::int8_channel};
  std::printf("kernels: fp32 %s; bf16 %s; int8 %s\n",
              sp::name_of(path == sp::cpu_path::avx512_bf16 ? sp::cpu_path::avx512 : path),
              path == sp::cpu_path::avx512_bf16 ? "AVX512-BF16 dot (inputs rounded to bf16)"
                                                : "widened to fp32",
              sp::name_of(sp::int8_kernel_for(path)));
  const bench::peaks peaks(cpus);
  std::printf(
      "compute: fp32 FMA %.1f, vpdpbusd %.1f, vdpbf16ps %.1f GMAC/s (%d threads at once; 0: "
      "not here)\n",
      peaks.fp32_fma, peaks.vnni, peaks.bf16, cpus);
  std::printf(
      "times: median of %d passes, the three formats back to back in each, caches "
      "evicted before each pass; roof: the active experts' packed bytes (weights + "
      "scales) / the faster read bandwidth (start, or beside the point); comp: T k 3 H F "
      "multiply-adds at the rate of the format's dot product (its kernel's: fp32 FMA, "
      "vpdpbusd or vdpbf16ps)\n\n",
      reps);

  for (const std::string& name : [&] {
         std::vector<std::string> v;
         for (std::size_t at = 0; at < shape_list.size();) {
           const std::size_t c = std::min(shape_list.find(',', at), shape_list.size());
           v.push_back(shape_list.substr(at, c - at));
           at = c + 1;
         }
         return v;
       }()) {
    const shape* s = nullptr;
    for (const shape& x : shapes)
      if (name == x.name) s = &x;
    if (!s) {
      std::fprintf(stderr, "unknown shape %s\n", name.c_str());
      return 2;
    }
    const index_t H = s->H, F = s->F, E = s->E;
    std::vector<float> w13(std::size_t(2 * E * F * H)), w2(std::size_t(E * H * F));
    {
      std::mt19937_64 rng(7);
      std::uniform_real_distribution<float> u(-1.f, 1.f);
      for (float& v : w13) v = u(rng) / std::sqrt(float(H));
      for (float& v : w2) v = u(rng) / std::sqrt(float(F));
    }
    const epmoe::expert::swiglu::weights w{
        {w13.data(), E, F, H}, {w13.data() + E * F * H, E, F, H}, {w2.data(), E, H, F}};
    if (group_only || minifloat_only) {
      if (group_only && !group_table(*s, w, tokens, reps, space0, probe.gbs, probe.streams,
                                     probe.prefetch, given_gbs, cpus, peaks))
        return 1;
      if (minifloat_only)
        minifloat_table(*s, w, tokens, reps, probe.gbs, given_gbs, probe.streams, probe.prefetch,
                        peaks);
      continue;
    }
    std::vector<point> pts;
    index_t max_rows = 0;
    for (index_t T : tokens) {
      point p;
      p.T = T;
      const auto rows = route(T, E, s->k, 11 + T);
      for (index_t n : rows) p.active += n > 0;
      max_rows = std::max(max_rows, T * s->k);
      pts.push_back(p);
    }
    std::vector<float> x0(std::size_t(max_rows * H)), x(x0.size()),
        scratch(std::size_t(max_rows * epmoe::expert::swiglu::scratch_per_row(F)));
    {
      std::mt19937_64 rng(9);
      std::uniform_real_distribution<float> u(-1.f, 1.f);
      for (float& v : x0) v = u(rng);
    }
    std::vector<float> flush_buffer(flush_floats(64), 1.f);
    volatile float sink = 0;
    const auto flush = [&] {
      float sum = 0;
      for (std::size_t i = 0; i < flush_buffer.size(); i += 16) sum += flush_buffer[i];
      sink = sink + sum;
    };
    // The three formats' copies at once, so that each rep times them back to back (the same
    // load from other jobs on the machine for all three).
    sp::packed_weights packed[3];
    sp::host spaces[3] = {space0, space0, space0};
    double per_expert[3];
    for (int f = 0; f < 3; ++f) {
      for (auto v : {w.w1, w.w3, w.w2}) packed[f].pack(v, formats[f]);
      packed[f].reserve_inputs(max_rows, path);
      spaces[f].use_packed(&packed[f]);
      per_expert[f] = double(packed[f].bytes()) / double(E);
    }
    for (point& p : pts) {
      const auto rows = route(p.T, E, s->k, 11 + p.T);
      std::vector<index_t> offsets(std::size_t(E + 1), 0);
      for (index_t e = 0; e < E; ++e)
        offsets[std::size_t(e + 1)] = offsets[std::size_t(e)] + rows[std::size_t(e)];
      const index_t n = offsets.back();
      const epmoe::grouped_rows<float> g{x.data(),      H, H, static_cast<int>(E), offsets.data(),
                                         offsets.data()};
      std::vector<double> t[3];
      for (int r = 0; r < reps + 1; ++r)
        for (int f = 0; f < 3; ++f) {
          std::memcpy(x.data(), x0.data(), std::size_t(n * H) * sizeof(float));
          flush();
          const auto start = bench::clock::now();
          epmoe::expert::swiglu::forward(spaces[f], w, g, scratch.data());
          if (r > 0) t[f].push_back(bench::seconds_since(start));
          for (index_t i = 0; i < n * H; ++i)
            if (!std::isfinite(x[std::size_t(i)])) {
              std::fprintf(stderr, "%s %s T=%lld: a non-finite output\n", s->name,
                           formats[f].name(), static_cast<long long>(p.T));
              return 1;
            }
        }
      for (int f = 0; f < 3; ++f) {
        std::sort(t[f].begin(), t[f].end());
        p.seconds[f] = t[f][t[f].size() / 2];
        p.bytes[f] = per_expert[f] * double(p.active);
      }
      // The read bandwidth now, over as many bytes as the bf16 pass reads (all cores).
      p.gbs = given_gbs > 0 ? given_gbs
                            : bench::read_bandwidth(std::size_t(std::max(p.bytes[1], 64e6)), cpus,
                                                    probe.streams, probe.prefetch);
    }
    std::printf("%s\n", s->note);
    std::printf("%6s %6s %6s | %9s %9s %9s | %9s %9s | %8s %8s %8s | %6s %6s %6s | %6s %6s %6s\n",
                "T", "active", "GB/s", "fp32 ms", "bf16 ms", "int8 ms", "int8/bf16", "int8/fp32",
                "int8 MB", "roof8 ms", "roof16ms", "%roof32", "%roof16", "%roof8", "%comp32",
                "%comp16", "%comp8");
    for (const point& p : pts) {
      // The faster of the run's start and the point's own: the shorter (stricter) roof.
      const auto roof = [&](int f) { return p.bytes[f] / (std::max(p.gbs, probe.gbs) * 1e9); };
      const auto comp = [&](int f) {
        return 100 * peaks.floor_ms(dot_of(formats[f], path), double(p.T * s->k) * 3 * H * F) /
               (1e3 * p.seconds[f]);
      };
      std::printf(
          "%6lld %6lld %6.1f | %9.3f %9.3f %9.3f | %8.2fx %8.2fx | %8.1f %8.3f %8.3f | %5.0f%% "
          "%5.0f%% %5.0f%% | %5.0f%% %5.0f%% %5.0f%%\n",
          static_cast<long long>(p.T), static_cast<long long>(p.active), p.gbs, 1e3 * p.seconds[0],
          1e3 * p.seconds[1], 1e3 * p.seconds[2], p.seconds[1] / p.seconds[2],
          p.seconds[0] / p.seconds[2], p.bytes[2] / 1e6, 1e3 * roof(2), 1e3 * roof(1),
          100 * roof(0) / p.seconds[0], 100 * roof(1) / p.seconds[1], 100 * roof(2) / p.seconds[2],
          comp(0), comp(1), comp(2));
    }
    std::printf("\n");
    for (auto& copy : packed) copy.clear();  // (room for the group-wise copies)
    if (!group_table(*s, w, tokens, reps, space0, probe.gbs, probe.streams, probe.prefetch,
                     given_gbs, cpus, peaks))
      return 1;
    minifloat_table(*s, w, tokens, reps, probe.gbs, given_gbs, probe.streams, probe.prefetch,
                    peaks);
  }
  return 0;
}
