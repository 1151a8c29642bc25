// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// The checks that run on cuda<float> and cuda<__nv_bfloat16>.
// One unit for several test files: each parses the layer's headers and the CUDA front end once
// (about 15 s of a file's 20 s; the test files keep their names in a namespace each).
#include "test_layer_reference.cu"
#include "test_user_policies.cu"
