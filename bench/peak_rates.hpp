// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// The compute roofline of a kernel's own dot product (issue 37's benchmarks): the rate at
// which this CPU retires the instruction that does a format's multiply-adds, measured at the
// start of a run on every thread at once (12 independent accumulators a thread, operands in
// registers: the instruction's throughput, nothing else). A pass's compute floor is its
// multiply-adds (T k 3 H F) over that rate; a kernel also converts, broadcasts and stores, so
// the floor is a bound no kernel reaches.

#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace bench {

/// The dot-product instructions a format's kernel may use.
enum class dot { fp32_fma, vnni, bf16 };

inline const char* name_of(dot d) {
  return d == dot::vnni ? "vpdpbusd" : d == dot::bf16 ? "vdpbf16ps" : "fp32 FMA";
}

#if defined(__x86_64__)
namespace peak_detail {

// Each kernel: `n` rounds of 12 independent instructions; returns multiply-adds done.
__attribute__((target("avx512f"))) inline double fma512(long n) {
  volatile float v = 1e-7f;
  const __m512 x = _mm512_set1_ps(v);
  __m512 a[12];
  for (auto& r : a) r = _mm512_setzero_ps();
  for (long k = 0; k < n; ++k) {
    _Pragma("GCC unroll 12") for (int i = 0; i < 12; ++i) a[i] = _mm512_fmadd_ps(x, x, a[i]);
  }
  for (int i = 1; i < 12; ++i) a[0] = _mm512_add_ps(a[0], a[i]);  // (every chain used)
  alignas(64) float out[16];
  _mm512_store_ps(out, a[0]);
  volatile float sink = out[0];
  (void)sink;
  return 12.0 * 16 * double(n);
}
__attribute__((target("avx2,fma"))) inline double fma256(long n) {
  volatile float v = 1e-7f;
  const __m256 x = _mm256_set1_ps(v);
  __m256 a[12];
  for (auto& r : a) r = _mm256_setzero_ps();
  for (long k = 0; k < n; ++k) {
    _Pragma("GCC unroll 12") for (int i = 0; i < 12; ++i) a[i] = _mm256_fmadd_ps(x, x, a[i]);
  }
  for (int i = 1; i < 12; ++i) a[0] = _mm256_add_ps(a[0], a[i]);
  alignas(32) float out[8];
  _mm256_store_ps(out, a[0]);
  volatile float sink = out[0];
  (void)sink;
  return 12.0 * 8 * double(n);
}
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline double vnni512(long n) {
  volatile char v = 1;
  const __m512i x = _mm512_set1_epi8(v);
  __m512i a[12];
  for (auto& r : a) r = _mm512_setzero_si512();
  for (long k = 0; k < n; ++k) {
    _Pragma("GCC unroll 12") for (int i = 0; i < 12; ++i) a[i] = _mm512_dpbusd_epi32(a[i], x, x);
  }
  for (int i = 1; i < 12; ++i) a[0] = _mm512_add_epi32(a[0], a[i]);
  alignas(64) int out[16];
  _mm512_store_si512(out, a[0]);
  volatile int sink = out[0];
  (void)sink;
  return 12.0 * 64 * double(n);
}
__attribute__((target("avx512f,avx512bf16"))) inline double bf16_512(long n) {
  volatile int v = 0x3f803f80;
  const __m512bh x = (__m512bh)_mm512_set1_epi32(v);
  __m512 a[12];
  for (auto& r : a) r = _mm512_setzero_ps();
  for (long k = 0; k < n; ++k) {
    _Pragma("GCC unroll 12") for (int i = 0; i < 12; ++i) a[i] = _mm512_dpbf16_ps(a[i], x, x);
  }
  for (int i = 1; i < 12; ++i) a[0] = _mm512_add_ps(a[0], a[i]);  // (every chain used)
  alignas(64) float out[16];
  _mm512_store_ps(out, a[0]);
  volatile float sink = out[0];
  (void)sink;
  return 12.0 * 32 * double(n);
}

}  // namespace peak_detail
#endif

/// Whether this CPU has the instruction (fp32 FMA: AVX-512 or AVX2+FMA).
inline bool cpu_has(dot d) {
#if defined(__x86_64__)
  if (d == dot::vnni)
    return __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
  if (d == dot::bf16) return __builtin_cpu_supports("avx512bf16");
  return __builtin_cpu_supports("avx512f") ||
         (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"));
#else
  (void)d;
  return false;
#endif
}

/// Multiply-adds per second (GMAC/s) of `d` on `threads` threads at once; 0 where the CPU
/// lacks it.
inline double peak_gmacs(dot d, int threads) {
  if (!cpu_has(d)) return 0;
#if defined(__x86_64__)
  const long n = 10'000'000;  // 20-50 ms a thread
  const auto one = [d] {
    if (d == dot::vnni) return peak_detail::vnni512(n);
    if (d == dot::bf16) return peak_detail::bf16_512(n);
    return __builtin_cpu_supports("avx512f") ? peak_detail::fma512(n) : peak_detail::fma256(n);
  };
  one();  // warm up: frequency, the upper halves of the vector units
  std::vector<std::thread> pool;
  std::vector<double> macs(static_cast<std::size_t>(threads), 0);
  const auto start = std::chrono::steady_clock::now();
  for (int t = 0; t < threads; ++t) pool.emplace_back([&, t] { macs[std::size_t(t)] = one(); });
  for (auto& th : pool) th.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  double total = 0;
  for (double m : macs) total += m;
  return total / s / 1e9;
#else
  return 0;
#endif
}

/// The rates of every dot product here, measured once at the start.
struct peaks {
  double fp32_fma = 0, vnni = 0, bf16 = 0;
  explicit peaks(int threads)
      : fp32_fma(peak_gmacs(dot::fp32_fma, threads)),
        vnni(peak_gmacs(dot::vnni, threads)),
        bf16(peak_gmacs(dot::bf16, threads)) {}
  double of(dot d) const { return d == dot::vnni ? vnni : d == dot::bf16 ? bf16 : fp32_fma; }
  /// Milliseconds of `macs` multiply-adds at d's rate (0 where unmeasured).
  double floor_ms(dot d, double macs) const { return of(d) > 0 ? 1e3 * macs / (of(d) * 1e9) : 0; }
};

}  // namespace bench
