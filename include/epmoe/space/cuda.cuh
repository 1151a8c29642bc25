// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// The CUDA space, for nvcc builds (link epmoe::cuda): space::cuda<T> (T = float,
// __nv_bfloat16 or __half) and its transports for in-process ranks (comm::local,
// comm::threads). A layer whose policies name space::cuda<T> is the same moe_layer as on the
// host: its stages run as the host's EPMOE_HD functors in kernels, CUB and cuBLAS on the
// space's streams. For NCCL ranks include epmoe/comm/nccl.cuh (link epmoe::nccl).
#include "epmoe/space/cuda/space.cuh"
#include "epmoe/space/cuda/transport.cuh"
