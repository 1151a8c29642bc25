// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// The routers, the backward and the device-only checks on cuda<float>.
// One unit for several test files: each parses the layer's headers and the CUDA front end once
// (about 15 s of a file's 20 s; the test files keep their names in a namespace each).
#include "test_routers.cu"
#include "test_scored.cu"
#include "test_layer_backward.cu"
#include "test_expert_backward.cu"
#include "test_device.cu"
