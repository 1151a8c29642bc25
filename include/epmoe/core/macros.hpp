// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// EPMOE_HD marks per-token math that runs on host and device: plain `inline` under a host
// compiler, `__host__ __device__` under nvcc, so the CPU tests check the code the GPU runs.
#if defined(__CUDACC__)
#define EPMOE_HD __host__ __device__ inline
#else
#define EPMOE_HD inline
#endif

#define EPMOE_VERSION_MAJOR 0
#define EPMOE_VERSION_MINOR 1
#define EPMOE_VERSION_PATCH 0
