// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
//
// CUDA smoke test: every core and policy header the CUDA build uses compiles under nvcc, and
// the per-token EPMOE_HD code (routing, gather, weighted reduce, SwiGLU activation,
// placement) runs in a kernel. Without a GPU on the machine it exits 77 (CTest "skipped"); on
// a machine with a GPU that CUDA cannot use it fails; otherwise it checks that the device
// computes what the host computes from the same functions.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "epmoe/capacity/dropless.hpp"
#include "epmoe/capacity/factor.hpp"
#include "epmoe/core/concepts.hpp"
#include "epmoe/core/config.hpp"
#include "epmoe/core/error.hpp"
#include "epmoe/core/plan.hpp"
#include "epmoe/core/routing.hpp"
#include "epmoe/core/rows.hpp"
#include "epmoe/core/stats.hpp"
#include "epmoe/core/topk.hpp"
#include "epmoe/core/view.hpp"
#include "epmoe/expert/swiglu.hpp"
#include "epmoe/placement/block.hpp"
#include "epmoe/router/hash.hpp"
#include "epmoe/router/jitter.hpp"
#include "epmoe/router/noisy_topk.hpp"
#include "epmoe/router/sigmoid_bias.hpp"
#include "epmoe/router/topk_softmax.hpp"
#include "epmoe/schedule/sequential.hpp"
#include "skip.hpp"

namespace {

constexpr int T = 37, E = 16, K = 4, H = 24, R = 4;
using router = epmoe::router::topk_softmax<K>;

static_assert(epmoe::router_policy<router>);
static_assert(epmoe::router_policy<epmoe::router::topk_softmax<1, false>>);
static_assert(epmoe::router_policy<epmoe::router::sigmoid_bias<8>>);
static_assert(epmoe::router_policy<epmoe::router::hash<2>>);
static_assert(epmoe::router_policy<epmoe::router::noisy_topk<2>>);
static_assert(epmoe::router_policy<epmoe::router::jitter<epmoe::router::switch_top1>>);

// The other per-token routers also instantiate in device code.
__global__ void other_routers(const float* logits, int* ids, float* w) {
  const epmoe::token_input in{logits, logits, E, 7, 3};
  epmoe::router::sigmoid_bias<K>{.groups = 4, .top_groups = 2, .scaling = 2.5f}.route_token(in, ids,
                                                                                            w);
  epmoe::router::hash<2>{}.route_token(in, ids + K, w + K);
  epmoe::router::noisy_topk<2>{.training = true, .seed = 1}.route_token(in, ids + K + 2, w + K + 2);
  w[K + 4] = epmoe::router::jitter<epmoe::router::switch_top1>{}.factor(1, 2, 3);
}

// A row functor over whole rows, one thread per row.
template <class F>
struct whole_rows {
  F f;
  epmoe::index_t width;
  __device__ void operator()(epmoe::index_t i) const { f(i, 0, width); }
};

template <class F>
__global__ void for_each_kernel(epmoe::index_t n, F f) {
  const epmoe::index_t i = blockIdx.x * epmoe::index_t{blockDim.x} + threadIdx.x;
  if (i < n) f(i);
}

// Placement and activation in one kernel: expert -> (rank, slot) -> expert, silu_mul.
__global__ void misc_kernel(epmoe::placement::block p, int* roundtrip, float* act) {
  const int e = threadIdx.x;
  if (e < p.experts) roundtrip[e] = p.expert_at(p.rank_of(e), p.local_index(e));
  if (e == 0) act[0] = epmoe::expert::silu_mul(1.5f, -2.f);
}

// Equal within a relative tolerance, NaN equal to NaN (a NaN logit makes its token NaN).
bool close(float a, float b, float tol) {
  return (std::isnan(a) && std::isnan(b)) || std::abs(a - b) <= tol * std::max(1.f, std::abs(b));
}

bool check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
  return e == cudaSuccess;
}

}  // namespace

int main() {
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices == 0)
    return epmoe::test::no_usable_gpu("cuda smoke",
                                      e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
  // Host inputs: logits with ties and a NaN, token rows, slots with a dropped assignment.
  std::vector<float> logits(T * E), x(T * H), w(T * K), y_host(T * H), y_dev(T * H);
  for (int i = 0; i < T * E; ++i) logits[i] = static_cast<float>((i * 7919) % 23) / 4.f;
  logits[5] = NAN;
  for (int i = 0; i < T * H; ++i) x[i] = static_cast<float>((i * 104729) % 17) / 8.f - 1.f;
  std::vector<std::int32_t> ids_host(T * K), ids_dev(T * K), slot(T * K), row_token(T * K);
  std::vector<float> w_dev(T * K);
  for (int i = 0; i < T * K; ++i) slot[i] = (i % 9 == 4) ? -1 : (i * 5) % (T * K);
  for (int i = 0; i < T * K; ++i) row_token[i] = (i % 11 == 3) ? -1 : i % T;

  // Host results from the very same functors.
  using epmoe::matrix_view;
  const router rt{.groups = 4, .top_groups = 2};  // group-limited softmax top-K
  epmoe::rows::route_tokens<router> route_h{
      rt, {logits.data(), T, E}, {}, {ids_host.data(), T, K}, {w.data(), T, K}, nullptr, 0, 0, E};
  for (int t = 0; t < T; ++t) route_h(t);
  std::vector<float> send_h(T * K * H), send_d(T * K * H);
  epmoe::rows::gather<float> gather_h{
      {x.data(), T, H}, row_token.data(), {send_h.data(), T * K, H}};
  for (int i = 0; i < T * K; ++i) gather_h(i, 0, H);
  epmoe::rows::weighted_reduce<float> reduce_h{
      {send_h.data(), T * K, H}, slot.data(), {w.data(), T, K}, nullptr, {y_host.data(), T, H}};
  for (int t = 0; t < T; ++t) reduce_h(t, 0, H);

  // Device: same inputs, same functors, one thread per token / row.
  float *d_logits, *d_x, *d_w, *d_send, *d_y, *d_act;
  std::int32_t *d_ids, *d_slot, *d_row_token;
  int* d_round;
  bool ok = check(cudaMalloc(&d_logits, sizeof(float) * T * E), "cudaMalloc") &&
            check(cudaMalloc(&d_x, sizeof(float) * T * H), "cudaMalloc") &&
            check(cudaMalloc(&d_w, sizeof(float) * T * K), "cudaMalloc") &&
            check(cudaMalloc(&d_send, sizeof(float) * T * K * H), "cudaMalloc") &&
            check(cudaMalloc(&d_y, sizeof(float) * T * H), "cudaMalloc") &&
            check(cudaMalloc(&d_act, sizeof(float)), "cudaMalloc") &&
            check(cudaMalloc(&d_ids, sizeof(std::int32_t) * T * K), "cudaMalloc") &&
            check(cudaMalloc(&d_slot, sizeof(std::int32_t) * T * K), "cudaMalloc") &&
            check(cudaMalloc(&d_row_token, sizeof(std::int32_t) * T * K), "cudaMalloc") &&
            check(cudaMalloc(&d_round, sizeof(int) * E), "cudaMalloc");
  if (!ok) return 1;
  cudaMemcpy(d_logits, logits.data(), sizeof(float) * T * E, cudaMemcpyHostToDevice);
  cudaMemcpy(d_x, x.data(), sizeof(float) * T * H, cudaMemcpyHostToDevice);
  cudaMemcpy(d_slot, slot.data(), sizeof(std::int32_t) * T * K, cudaMemcpyHostToDevice);
  cudaMemcpy(d_row_token, row_token.data(), sizeof(std::int32_t) * T * K, cudaMemcpyHostToDevice);
  cudaMemset(d_y, 0xff, sizeof(float) * T * H);  // NaN: a row the reduce skips mismatches

  for_each_kernel<<<1, 64>>>(
      T, epmoe::rows::route_tokens<router>{
             rt, {d_logits, T, E}, {}, {d_ids, T, K}, {d_w, T, K}, nullptr, 0, 0, E});
  for_each_kernel<<<(T * K + 63) / 64, 64>>>(
      T * K,
      whole_rows<epmoe::rows::gather<float>>{{{d_x, T, H}, d_row_token, {d_send, T * K, H}}, H});
  for_each_kernel<<<1, 64>>>(
      T, whole_rows<epmoe::rows::weighted_reduce<float>>{
             {{d_send, T * K, H}, d_slot, {d_w, T, K}, nullptr, {d_y, T, H}}, H});
  epmoe::layer_config cfg{
      .hidden = H, .ffn = 8, .experts = E, .top_k = K, .ranks = R, .max_tokens = T};
  other_routers<<<1, 1>>>(d_logits + E, d_ids, d_w);  // results unchecked: it must build
  if (!check(cudaDeviceSynchronize(), "other routers")) return 1;
  for_each_kernel<<<1, 64>>>(
      T, epmoe::rows::route_tokens<router>{
             rt, {d_logits, T, E}, {}, {d_ids, T, K}, {d_w, T, K}, nullptr, 0, 0, E});
  misc_kernel<<<1, E>>>(epmoe::placement::block(cfg), d_round, d_act);
  if (!check(cudaDeviceSynchronize(), "kernels")) return 1;

  std::vector<int> round(E);
  float act = 0;
  cudaMemcpy(ids_dev.data(), d_ids, sizeof(std::int32_t) * T * K, cudaMemcpyDeviceToHost);
  cudaMemcpy(w_dev.data(), d_w, sizeof(float) * T * K, cudaMemcpyDeviceToHost);
  cudaMemcpy(y_dev.data(), d_y, sizeof(float) * T * H, cudaMemcpyDeviceToHost);
  cudaMemcpy(round.data(), d_round, sizeof(int) * E, cudaMemcpyDeviceToHost);
  cudaMemcpy(&act, d_act, sizeof(float), cudaMemcpyDeviceToHost);

  int bad = 0;
  for (int i = 0; i < T * K; ++i) {
    bad += ids_dev[i] != ids_host[i];
    bad += !close(w_dev[i], w[i], 1e-6f);
  }
  for (int i = 0; i < T * H; ++i) bad += !close(y_dev[i], y_host[i], 1e-5f);
  for (int e = 0; e < E; ++e) bad += round[e] != e;
  bad += !close(act, epmoe::expert::silu_mul(1.5f, -2.f), 1e-6f);
  std::printf("cuda smoke: %d mismatches between device and host\n", bad);
  return bad == 0 ? 0 : 1;
}
