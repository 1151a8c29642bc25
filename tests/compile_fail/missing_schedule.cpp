// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
// Must not compile: the schedule has no run; the layer's check names that member (core/checks.hpp).
#define EPMOE_STAND_IN_WITHOUT_RUN
#include "../policies/stand_ins.hpp"

int main() { return sizeof(epmoe::moe_layer<stand_in::policies>) > 0 ? 0 : 1; }
