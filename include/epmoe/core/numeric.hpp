// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "epmoe/core/macros.hpp"

// Element types of activations and weights: float on the host; a device space adds 16-bit
// types by specialising `scalar` (space/cuda/runtime.cuh). Math and sums run in float.
namespace epmoe {

template <class T>
struct scalar {
  EPMOE_HD static float to_float(T v) { return static_cast<float>(v); }
  EPMOE_HD static T from_float(float v) { return static_cast<T>(v); }
};

template <class T>
EPMOE_HD float to_float(T v) {
  return scalar<T>::to_float(v);
}
template <class T>
EPMOE_HD T from_float(float v) {
  return scalar<T>::from_float(v);
}

}  // namespace epmoe
