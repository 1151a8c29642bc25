// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// The decode paths of tests/layer/test_decode_spaces.cpp (the low-latency exchange, split
// passes in flight) on the GPU.
#define EPMOE_TEST_SPACES epmoe::space::cuda<float>
// clang-format off
#include "space_io.cuh"
#include "../layer/test_decode_spaces.cpp"
// clang-format on
