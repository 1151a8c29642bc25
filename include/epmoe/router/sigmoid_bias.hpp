// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// router::sigmoid_bias<K> (DeepSeek-V3) is router::biased<K, score::sigmoid>: its header.
#include "epmoe/router/biased.hpp"
