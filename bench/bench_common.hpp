// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// The benchmarks' shared parts: the shapes, a small harness (warm-up, repetitions, medians),
// what the machine is (CPU, BLAS core and threads, read bandwidth, one sgemm's rate), and a
// JSON writer. Benchmarks print ratios measured side by side in one run; nothing here asserts
// a time.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../examples/args.hpp"  // --help and bad flags, as the examples
#include <epmoe/epmoe.hpp>
#include <epmoe/router/sigmoid_bias.hpp>

#if defined(EPMOE_HAS_OPENBLAS)
extern "C" {
char* openblas_get_corename(void);
char* openblas_get_config(void);
}
#endif

namespace bench {

using epmoe::index_t;
using epmoe::layer_config;

// --- shapes -----------------------------------------------------------------------------

/// One layer shape of the benchmark. `deepseek` selects the DeepSeek-like policies (sigmoid +
/// bias router, group-limited) instead of Mixtral's softmax top-K.
struct shape {
  std::string name;
  layer_config cfg;
  bool deepseek = false;
  int groups = 1, top_groups = 1;
};

inline std::vector<shape> all_shapes() {
  return {
      {"mixtral", {.hidden = 1024, .ffn = 3584, .experts = 8, .top_k = 2}, false},
      {"deepseek",
       {.hidden = 1024, .ffn = 512, .experts = 64, .top_k = 6, .shared_experts = 2},
       true,
       8,
       4},
      // Tiny versions of both, for the CTest smoke runs.
      {"tiny-mixtral", {.hidden = 64, .ffn = 224, .experts = 8, .top_k = 2}, false},
      {"tiny-deepseek",
       {.hidden = 64, .ffn = 32, .experts = 16, .top_k = 4, .shared_experts = 2},
       true,
       4,
       2},
  };
}

inline shape find_shape(const std::string& name) {
  for (const shape& s : all_shapes())
    if (s.name == name) return s;
  std::fprintf(stderr, "unknown shape '%s' (mixtral, deepseek, tiny-mixtral, tiny-deepseek)\n",
               name.c_str());
  std::exit(2);
}

/// "mixtral,deepseek" -> shapes; "all" = the two real ones, "tiny" = the two tiny ones.
inline std::vector<shape> parse_shapes(const std::string& list) {
  std::vector<shape> out;
  std::stringstream ss(list);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item == "all") {
      out.push_back(find_shape("mixtral"));
      out.push_back(find_shape("deepseek"));
    } else if (item == "tiny") {
      out.push_back(find_shape("tiny-mixtral"));
      out.push_back(find_shape("tiny-deepseek"));
    } else {
      out.push_back(find_shape(item));
    }
  }
  return out;
}

inline std::vector<index_t> parse_list(const std::string& list) {
  std::vector<index_t> out;
  std::stringstream ss(list);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(std::atoll(item.c_str()));
  return out;
}

/// The token counts after the current flag ("1,16,128"): at least one, each >= 1.
inline std::vector<index_t> token_list(cli::command_line& cl) {
  const std::string text = cl.value();
  const std::vector<index_t> list = parse_list(text);
  if (list.empty()) cl.fail("needs at least one token count: " + text);
  for (index_t t : list)
    if (t < 1) cl.fail("token counts must be >= 1: " + text);
  return list;
}

// Policy bundles of the two shapes, for any comm, with or without per-rank dedup.
template <class Comm, bool Dedup>
struct mixtral_policies : epmoe::default_policies {
  using router = epmoe::router::mixtral<2>;
  using comm = Comm;
  static constexpr epmoe::layer_options options{.dedup = Dedup};
};
template <class Comm, bool Dedup>
struct deepseek_policies : epmoe::default_policies {
  using router = epmoe::router::sigmoid_bias<6>;
  using comm = Comm;
  static constexpr epmoe::layer_options options{.dedup = Dedup};
};
// The tiny DeepSeek-like shape has K=4.
template <class Comm, bool Dedup>
struct tiny_deepseek_policies : deepseek_policies<Comm, Dedup> {
  using router = epmoe::router::sigmoid_bias<4>;
};

/// Calls f.template operator()<Policies>(router) with the policies and router of shape s.
template <class Comm, bool Dedup, class F>
decltype(auto) with_policies(const shape& s, F&& f) {
  if (!s.deepseek)
    return f.template operator()<mixtral_policies<Comm, Dedup>>(epmoe::router::mixtral<2>{});
  if (s.cfg.top_k == 6)
    return f.template operator()<deepseek_policies<Comm, Dedup>>(
        epmoe::router::sigmoid_bias<6>{.groups = s.groups, .top_groups = s.top_groups});
  return f.template operator()<tiny_deepseek_policies<Comm, Dedup>>(
      epmoe::router::sigmoid_bias<4>{.groups = s.groups, .top_groups = s.top_groups});
}

// --- harness ----------------------------------------------------------------------------

using clock = std::chrono::steady_clock;
inline double seconds_since(clock::time_point t) {
  return std::chrono::duration<double>(clock::now() - t).count();
}

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// How many timed repetitions: at least min_reps, then more until min_seconds have passed,
/// at most max_reps. One untimed warm-up comes first.
struct rep_policy {
  int min_reps = 5;
  int max_reps = 40;
  double min_seconds = 2.0;
};

/// Runs rep(i) (which times what it wants) for i = 0, 1, ...: one warm-up (i = -1), then as
/// many as the policy asks; returns the number of timed repetitions.
inline int repeat(const rep_policy& p, const std::function<void(int)>& rep) {
  rep(-1);
  const auto start = clock::now();
  int n = 0;
  while (n < p.max_reps && (n < p.min_reps || seconds_since(start) < p.min_seconds)) rep(n++);
  return n;
}

// --- the machine ------------------------------------------------------------------------

inline std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      return colon == std::string::npos ? line : line.substr(colon + 2);
    }
  return "unknown";
}

/// Whether /proc/cpuinfo lists `flag` ("avx512f": the SkylakeX kernels of OpenBLAS run).
inline bool cpu_has(const std::string& flag) {
  std::ifstream in("/proc/cpuinfo");
  std::string line, word;
  while (std::getline(in, line))
    if (line.rfind("flags", 0) == 0) {
      std::istringstream words(line);
      while (words >> word)
        if (word == flag) return true;
      return false;
    }
  return false;
}

inline std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

inline std::string blas_core() {
#if defined(EPMOE_HAS_OPENBLAS)
  return openblas_get_corename();
#else
  return "n/a";
#endif
}

inline std::string blas_config() {
#if defined(EPMOE_HAS_OPENBLAS)
  return openblas_get_config();
#else
  return epmoe::space::host_gemm_backend();
#endif
}

// The BLAS's threads per call: the library's (OpenBLAS; 1 and a no-op otherwise).
using epmoe::space::blas_threads;
using epmoe::space::set_blas_threads;

/// GB/s of plain reads of a `bytes` array (far larger than the caches) by `threads` threads,
/// each reading its share as `streams` (1 or 4) interleaved sequential streams, optionally
/// prefetching 2 KB ahead in software (more lines in flight, as the streaming GEMM does);
/// median of 5 sweeps.
inline double read_bandwidth(std::size_t bytes, int threads, int streams, bool prefetch) {
  using v8 = float __attribute__((vector_size(32)));
  const std::size_t n = bytes / sizeof(v8);
  std::unique_ptr<v8[]> a(new v8[n]);
  for (std::size_t i = 0; i < n; ++i) a[i] = v8{} + 1.f;  // touch every page
  std::vector<double> t;
  volatile float sink = 0;
  constexpr std::size_t ahead = 64;  // v8 elements: 2 KB
  for (int r = 0; r < 6; ++r) {
    std::vector<float> part(static_cast<std::size_t>(threads));
    const auto start = clock::now();
    std::vector<std::thread> pool;
    for (int k = 0; k < threads; ++k)
      pool.emplace_back([&, k] {
        const std::size_t b = n * k / threads, e = n * (k + 1) / threads;
        v8 s0{}, s1{}, s2{}, s3{};
        if (streams == 1) {
          for (std::size_t i = b; i + 4 <= e; i += 4) {
            if (prefetch && i + ahead < e) __builtin_prefetch(&a[i + ahead]);
            s0 += a[i], s1 += a[i + 1], s2 += a[i + 2], s3 += a[i + 3];
          }
        } else {
          const std::size_t len = (e - b) / 4;
          const v8 *p0 = &a[b], *p1 = p0 + len, *p2 = p1 + len, *p3 = p2 + len;
          for (std::size_t i = 0; i < len; ++i) {
            if (prefetch && i % 2 == 0 && i + ahead < len) {
              __builtin_prefetch(p0 + i + ahead);
              __builtin_prefetch(p1 + i + ahead);
              __builtin_prefetch(p2 + i + ahead);
              __builtin_prefetch(p3 + i + ahead);
            }
            s0 += p0[i], s1 += p1[i], s2 += p2[i], s3 += p3[i];
          }
        }
        const v8 sum = s0 + s1 + s2 + s3;
        part[k] = sum[0] + sum[7];
      });
    for (auto& th : pool) th.join();
    if (r > 0) t.push_back(seconds_since(start));  // the first sweep warms up
    sink = sink + part[0];
  }
  return static_cast<double>(n * sizeof(v8)) / median(t) * 1e-9;
}

/// The best of 1 and 4 streams per thread, with and without software prefetch.
inline double read_bandwidth(std::size_t bytes, int threads) {
  double best = 0;
  for (int streams : {1, 4})
    for (bool prefetch : {false, true})
      best = std::max(best, read_bandwidth(bytes, threads, streams, prefetch));
  return best;
}

/// GFLOP/s of one C[M,N] = A[M,K] B[N,K]^T call of the BLAS (the layer's call shape).
inline double blas_sgemm_rate(index_t M, index_t N, index_t K) {
  std::vector<float> a(M * K, 0.5f), b(N * K, 0.25f), c(M * N);
  std::vector<double> t;
  for (int r = 0; r < 4; ++r) {
    const auto start = clock::now();
#if defined(EPMOE_HAS_CBLAS)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(M), static_cast<int>(N),
                static_cast<int>(K), 1.f, a.data(), static_cast<int>(K), b.data(),
                static_cast<int>(K), 0.f, c.data(), static_cast<int>(N));
#else
    epmoe::space::host_gemm_nt({a.data(), M, K}, {b.data(), N, K}, {c.data(), M, N});
#endif
    if (r > 0) t.push_back(seconds_since(start));
  }
  return 2.0 * M * N * K / median(t) * 1e-9;
}

// --- JSON -------------------------------------------------------------------------------

/// A JSON value written as text as it is built: objects keep insertion order.
class json {
 public:
  static json object() { return json("{", "}"); }
  static json array() { return json("[", "]"); }

  json& add(const std::string& key, const json& v) { return put(quote(key) + ":" + v.str()); }
  json& add(const std::string& key, const std::string& v) {
    return put(quote(key) + ":" + quote(v));
  }
  json& add(const std::string& key, const char* v) { return add(key, std::string(v)); }
  json& add(const std::string& key, double v) { return put(quote(key) + ":" + number(v)); }
  json& add(const std::string& key, long long v) {
    return put(quote(key) + ":" + std::to_string(v));
  }
  json& add(const std::string& key, int v) { return add(key, static_cast<long long>(v)); }
  json& add(const std::string& key, long v) { return add(key, static_cast<long long>(v)); }
  json& add(const std::string& key, bool v) {
    return put(quote(key) + ":" + (v ? "true" : "false"));
  }
  json& push(const json& v) { return put(v.str()); }
  json& push(double v) { return put(number(v)); }

  std::string str() const { return open_ + body_ + close_; }

  static std::string quote(const std::string& s) {
    std::string o = "\"";
    for (char ch : s) {
      if (ch == '"' || ch == '\\') {
        o += '\\';
        o += ch;
      } else if (static_cast<unsigned char>(ch) < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\u%04x", ch);
        o += buf;
      } else {
        o += ch;
      }
    }
    return o + "\"";
  }
  static std::string number(double v) {
    if (!std::isfinite(v)) return "null";
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.6g", v);
    return buf;
  }

 private:
  json(const char* o, const char* c) : open_(o), close_(c) {}
  json& put(const std::string& item) {
    if (!body_.empty()) body_ += ",";
    body_ += item;
    return *this;
  }
  std::string open_, close_, body_;
};

/// Median of one stage's time over the repetitions, in ms.
inline double median_of(const std::vector<epmoe::stage_times>& t, double epmoe::stage_times::*f) {
  std::vector<double> v;
  for (const auto& s : t) v.push_back(s.*f * 1e3);
  return median(v);
}

inline json stage_json(const std::vector<epmoe::stage_times>& t) {
  const auto med = [&](double epmoe::stage_times::*f) { return median_of(t, f); };
  json j = json::object();
  j.add("route", med(&epmoe::stage_times::route))
      .add("plan", med(&epmoe::stage_times::plan))
      .add("permute", med(&epmoe::stage_times::permute))
      .add("shared", med(&epmoe::stage_times::shared))
      .add("dispatch", med(&epmoe::stage_times::dispatch))
      .add("experts", med(&epmoe::stage_times::experts))
      .add("combine", med(&epmoe::stage_times::combine))
      .add("reduce", med(&epmoe::stage_times::reduce))
      .add("total", med(&epmoe::stage_times::total));
  return j;
}

/// "route 0.12 plan 0.01 ... reduce 0.30": each stage's median ms, for a table row.
inline std::string stage_text(const std::vector<epmoe::stage_times>& t) {
  using st = epmoe::stage_times;
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "route %.2f plan %.2f permute %.2f shared %.2f dispatch %.2f experts %.2f "
                "combine %.2f reduce %.2f",
                median_of(t, &st::route), median_of(t, &st::plan), median_of(t, &st::permute),
                median_of(t, &st::shared), median_of(t, &st::dispatch), median_of(t, &st::experts),
                median_of(t, &st::combine), median_of(t, &st::reduce));
  return buf;
}

/// What the machine is, measured now: printed first, and the "machine" object of the JSON.
struct machine {
  std::string cpu;
  int cpus = 0;
  bool avx512 = false;
  std::string gemm, blas_core, blas_config, coretype_env, blas_threads_env;
  int blas_threads = 1;
  double read_gbs_1 = 0, read_gbs_all = 0, sgemm_gflops = 0;
  bool given = false;  // read bandwidth given on the command line (--read-gbs), not measured

  /// quick: small arrays and matrices (smoke runs). given_gbs > 0: take that read bandwidth
  /// (measured by an earlier run of this program) instead of measuring it again.
  /// bandwidth = false: leave it unmeasured (NaN, null in the JSON) for a benchmark that does
  /// not compare with it.
  static machine measure(bool quick, double given_gbs = 0, bool bandwidth = true) {
    machine m;
    m.cpu = cpu_model();
    m.cpus = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    m.avx512 = cpu_has("avx512f");
    m.gemm = epmoe::space::host_gemm_backend();
    m.blas_core = bench::blas_core();
    m.blas_config = bench::blas_config();
    m.coretype_env = env_or("OPENBLAS_CORETYPE", "");
    m.blas_threads_env = env_or("OPENBLAS_NUM_THREADS", "");
    m.blas_threads = bench::blas_threads();
    const std::size_t bytes = quick ? (std::size_t{16} << 20) : (std::size_t{512} << 20);
    if (given_gbs > 0) {
      m.read_gbs_1 = m.read_gbs_all = given_gbs;
      m.sgemm_gflops = blas_sgemm_rate(64, 128, 64);
      m.given = true;
      return m;
    }
    m.read_gbs_1 = bandwidth ? read_bandwidth(bytes, 1) : NAN;
    m.read_gbs_all = bandwidth ? read_bandwidth(bytes, m.cpus) : NAN;
    m.sgemm_gflops = quick ? blas_sgemm_rate(64, 128, 64) : blas_sgemm_rate(1024, 4096, 1024);
    return m;
  }
  /// The bandwidth the memory-bound figure compares with: the best the machine reached.
  double read_gbs() const { return std::max(read_gbs_1, read_gbs_all); }

  void print(std::FILE* out) const {
    std::fprintf(out, "machine: %s, %d logical CPUs, AVX-512 %s\n", cpu.c_str(), cpus,
                 avx512 ? "yes" : "no");
    std::fprintf(out,
                 "GEMM: %s; BLAS core %s, %d BLAS threads (OPENBLAS_CORETYPE=%s, "
                 "OPENBLAS_NUM_THREADS=%s)\n",
                 gemm.c_str(), blas_core.c_str(), blas_threads, coretype_env.c_str(),
                 blas_threads_env.c_str());
    std::fprintf(out, "BLAS config: %s\n", blas_config.c_str());
    if (given)
      std::fprintf(out, "read bandwidth: %.1f GB/s (given, --read-gbs)\n\n", read_gbs_all);
    else if (std::isnan(read_gbs_all))
      std::fprintf(out, "sgemm 1024x4096x1024: %.1f GFLOP/s\n\n", sgemm_gflops);
    else
      std::fprintf(out,
                   "read bandwidth: %.1f GB/s (1 thread), %.1f GB/s (%d threads); "
                   "sgemm 1024x4096x1024: %.1f GFLOP/s\n\n",
                   read_gbs_1, read_gbs_all, cpus, sgemm_gflops);
  }
  json to_json() const {
    json j = json::object();
    j.add("cpu", cpu)
        .add("logical_cpus", cpus)
        .add("avx512", avx512)
        .add("gemm", gemm)
        .add("blas_core", blas_core)
        .add("blas_config", blas_config)
        .add("blas_threads", blas_threads)
        .add("env_OPENBLAS_CORETYPE", coretype_env)
        .add("env_OPENBLAS_NUM_THREADS", blas_threads_env)
        .add("read_gbs_1_thread", read_gbs_1)
        .add("read_gbs_all_threads", read_gbs_all)
        .add("read_gbs_given", given)
        .add("sgemm_1024x4096x1024_gflops", given ? 0.0 : sgemm_gflops);
    return j;
  }
};

/// Writes text to `path` ("-" = stdout).
inline void write_text(const std::string& path, const std::string& text) {
  if (path == "-") {
    std::fputs(text.c_str(), stdout);
    std::fputc('\n', stdout);
    return;
  }
  std::ofstream out(path);
  out << text << '\n';
  if (!out) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    std::exit(1);
  }
}

}  // namespace bench
