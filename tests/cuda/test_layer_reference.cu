// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// The host's layer-vs-reference checks (tests/layer/test_layer_reference.cpp), on the GPU.
#define EPMOE_TEST_SPACES epmoe::space::cuda<float>, epmoe::space::cuda<__nv_bfloat16>
// The space's data movement first, then the host test file.
// clang-format off
#include "space_io.cuh"
#include "../layer/test_layer_reference.cpp"
// clang-format on
