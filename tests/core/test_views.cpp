// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include <epmoe/core/error.hpp>
#include <epmoe/core/view.hpp>

using epmoe::index_t;
using epmoe::matrix_view;
using epmoe::stacked_view;

namespace {

// Element i of the buffer holds i, so a value read through a view tells where it came from.
std::vector<float> iota_buffer(std::size_t n) {
  std::vector<float> v(n);
  std::iota(v.begin(), v.end(), 0.f);
  return v;
}

template <class F>
std::string field_of(F&& f) {
  try {
    f();
  } catch (const epmoe::config_error& e) {
    return e.field();
  }
  return "<no config_error>";
}

}  // namespace

TEST_CASE("views: matrix_view row, element and rows_slice honour a stride > cols", "[view]") {
  auto buf = iota_buffer(5 * 7);
  const matrix_view<float> m(buf.data(), 5, 4, 7);  // 4 of every 7 elements used
  REQUIRE(m.stride == 7);

  CHECK(m.row(0) == buf.data());
  CHECK(m.row(3) == buf.data() + 21);
  for (index_t i = 0; i < m.rows; ++i)
    for (index_t j = 0; j < m.cols; ++j) CHECK(m(i, j) == static_cast<float>(i * 7 + j));

  m(2, 3) = -1.f;  // writes through the view land at i*stride + j
  CHECK(buf[2 * 7 + 3] == -1.f);

  const matrix_view<float> s = m.rows_slice(1, 3);
  CHECK(s.data == buf.data() + 7);
  CHECK(s.rows == 3);
  CHECK(s.cols == 4);
  CHECK(s.stride == 7);
  CHECK(s(0, 0) == 7.f);
  CHECK(s(1, 3) == -1.f);  // m(2, 3)
  CHECK(s(2, 1) == static_cast<float>(3 * 7 + 1));

  const matrix_view<float> empty = m.rows_slice(5, 0);
  CHECK(empty.rows == 0);
  CHECK(empty.data == buf.data() + 35);
}

TEST_CASE("views: a dense matrix_view has stride == cols", "[view]") {
  auto buf = iota_buffer(12);
  const matrix_view<float> m(buf.data(), 3, 4);
  CHECK(m.stride == 4);
  CHECK(m(2, 1) == 9.f);
  const matrix_view<float> none;
  CHECK(none.data == nullptr);
  CHECK(none.rows == 0);
  CHECK(none.cols == 0);
  CHECK(none.stride == 0);
}

TEST_CASE("views: a view of T converts to a view of const T", "[view]") {
  STATIC_REQUIRE(std::is_convertible_v<matrix_view<float>, matrix_view<const float>>);
  STATIC_REQUIRE_FALSE(std::is_convertible_v<matrix_view<const float>, matrix_view<float>>);
  STATIC_REQUIRE(std::is_convertible_v<stacked_view<float>, stacked_view<const float>>);
  STATIC_REQUIRE_FALSE(std::is_convertible_v<stacked_view<const float>, stacked_view<float>>);

  auto buf = iota_buffer(3 * 6);
  const matrix_view<float> m(buf.data(), 3, 5, 6);
  const matrix_view<const float> c = m;
  CHECK(c.data == buf.data());
  CHECK(c.rows == 3);
  CHECK(c.cols == 5);
  CHECK(c.stride == 6);
  CHECK(c(2, 4) == 16.f);

  const stacked_view<float> st(buf.data(), 2, 2, 3, 4, 9);
  const stacked_view<const float> cs = st;
  CHECK(cs.data == buf.data());
  CHECK(cs.count == 2);
  CHECK(cs.rows == 2);
  CHECK(cs.cols == 3);
  CHECK(cs.stride == 4);
  CHECK(cs.batch_stride == 9);
}

TEST_CASE("views: stacked_view indexes matrices by batch stride", "[view]") {
  auto buf = iota_buffer(3 * 20);
  // 3 matrices [2, 3], row stride 5, one every 20 elements.
  const stacked_view<float> st(buf.data(), 3, 2, 3, 5, 20);
  for (index_t b = 0; b < st.count; ++b) {
    const matrix_view<float> m = st[b];
    CHECK(m.data == buf.data() + b * 20);
    CHECK(m.rows == 2);
    CHECK(m.cols == 3);
    CHECK(m.stride == 5);
    for (index_t i = 0; i < 2; ++i)
      for (index_t j = 0; j < 3; ++j) CHECK(m(i, j) == static_cast<float>(b * 20 + i * 5 + j));
  }

  // The dense constructor packs matrices back to back.
  const stacked_view<float> dense(buf.data(), 4, 3, 5);
  CHECK(dense.stride == 5);
  CHECK(dense.batch_stride == 15);
  CHECK(dense[2](1, 4) == static_cast<float>(2 * 15 + 1 * 5 + 4));
}

TEST_CASE("views: require_shape accepts a matching view", "[view]") {
  auto buf = iota_buffer(4 * 6);
  const matrix_view<const float> m(buf.data(), 4, 5, 6);
  CHECK_NOTHROW(epmoe::detail::require_shape(m, 4, 5, "x"));
  // An empty view may have no data.
  CHECK_NOTHROW(epmoe::detail::require_shape(matrix_view<const float>(nullptr, 0, 5), 0, 5, "x"));
  const stacked_view<const float> st(buf.data(), 2, 2, 5, 6, 12);
  CHECK_NOTHROW(epmoe::detail::require_shape(st, 2, 2, 5, "w"));
}

TEST_CASE("views: require_shape with wrong rows or cols names the field", "[view]") {
  auto buf = iota_buffer(4 * 5);
  const matrix_view<const float> m(buf.data(), 4, 5);
  try {
    epmoe::detail::require_shape(m, 3, 5, "weights.gate");
    FAIL("a [4,5] view passed as [3,5]");
  } catch (const epmoe::config_error& e) {
    CHECK(e.field() == "weights.gate");
    CHECK(e.value() == "[4,5]");
    CHECK_THAT(e.rule(), Catch::Matchers::Contains("[3,5]"));
  }
  CHECK(field_of([&] { epmoe::detail::require_shape(m, 4, 6, "y"); }) == "y");
}

TEST_CASE("views: require_shape with stride < cols names the field", "[view]") {
  auto buf = iota_buffer(20);
  const matrix_view<const float> m(buf.data(), 4, 5, 3);
  try {
    epmoe::detail::require_shape(m, 4, 5, "x");
    FAIL("a view with stride 3 < 5 cols passed");
  } catch (const epmoe::config_error& e) {
    CHECK(e.field() == "x");
    CHECK_THAT(e.value(), Catch::Matchers::Contains("3"));
  }
}

TEST_CASE("views: require_shape with null data names the field", "[view]") {
  const matrix_view<const float> m(nullptr, 2, 5);
  try {
    epmoe::detail::require_shape(m, 2, 5, "x");
    FAIL("a null [2,5] view passed");
  } catch (const epmoe::config_error& e) {
    CHECK(e.field() == "x");
    CHECK(e.value() == "null");
  }
}

TEST_CASE("views: require_shape on a stacked_view names the field", "[view]") {
  auto buf = iota_buffer(64);
  const char* f = "weights.experts.w1";
  // wrong count, rows, cols
  CHECK(field_of([&] {
          epmoe::detail::require_shape(stacked_view<const float>(buf.data(), 3, 2, 4), 2, 2, 4, f);
        }) == f);
  CHECK(field_of([&] {
          epmoe::detail::require_shape(stacked_view<const float>(buf.data(), 2, 3, 4), 2, 2, 4, f);
        }) == f);
  CHECK(field_of([&] {
          epmoe::detail::require_shape(stacked_view<const float>(buf.data(), 2, 2, 5), 2, 2, 4, f);
        }) == f);
  // row stride < cols; batch stride < rows * stride (matrices would overlap)
  CHECK(field_of([&] {
          epmoe::detail::require_shape(stacked_view<const float>(buf.data(), 2, 2, 4, 3, 8), 2, 2,
                                       4, f);
        }) == f);
  CHECK(field_of([&] {
          epmoe::detail::require_shape(stacked_view<const float>(buf.data(), 2, 2, 4, 4, 7), 2, 2,
                                       4, f);
        }) == f);
  // null data
  CHECK(field_of([&] {
          epmoe::detail::require_shape(stacked_view<const float>(nullptr, 2, 2, 4), 2, 2, 4, f);
        }) == f);
}
