// SPDX-FileCopyrightText: 2026 The epmoe authors
// SPDX-License-Identifier: Apache-2.0
#pragma once

// A small strict JSON reader for the report tests: throws on anything RFC 8259 rejects.
#include <cctype>
#include <cstdlib>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace epmoe::test::json {

struct value {
  enum kind_t { null, boolean, number, string, array, object } kind = null;
  bool b = false;
  double n = 0;
  std::string s;
  std::vector<value> a;
  std::map<std::string, value> o;

  const value& operator[](const std::string& key) const {
    const auto it = o.find(key);
    if (kind != object || it == o.end()) throw std::out_of_range("json: no key " + key);
    return it->second;
  }
  bool has(const std::string& key) const { return kind == object && o.count(key) > 0; }
};

class parser {
 public:
  explicit parser(const std::string& text) : t_(text) {}
  value parse() {
    value v = any();
    ws();
    if (i_ != t_.size()) fail("trailing characters");
    return v;
  }

 private:
  [[noreturn]] void fail(const char* what) const {
    throw std::runtime_error(std::string("json: ") + what + " at offset " + std::to_string(i_));
  }
  void ws() {
    while (i_ < t_.size() && (t_[i_] == ' ' || t_[i_] == '\n' || t_[i_] == '\r' || t_[i_] == '\t'))
      ++i_;
  }
  bool eat(char c) {
    ws();
    if (i_ < t_.size() && t_[i_] == c) return ++i_, true;
    return false;
  }
  void expect(char c) {
    if (!eat(c)) fail("unexpected character");
  }
  bool word(const char* w) {
    const std::string s(w);
    if (t_.compare(i_, s.size(), s) == 0) return i_ += s.size(), true;
    return false;
  }
  value any() {
    ws();
    if (i_ >= t_.size()) fail("unexpected end");
    value v;
    const char c = t_[i_];
    if (c == '{') {
      ++i_;
      v.kind = value::object;
      if (eat('}')) return v;
      do {
        ws();
        const std::string key = str();
        expect(':');
        v.o[key] = any();
      } while (eat(','));
      expect('}');
    } else if (c == '[') {
      ++i_;
      v.kind = value::array;
      if (eat(']')) return v;
      do v.a.push_back(any());
      while (eat(','));
      expect(']');
    } else if (c == '"') {
      v.kind = value::string;
      v.s = str();
    } else if (word("true")) {
      v.kind = value::boolean, v.b = true;
    } else if (word("false")) {
      v.kind = value::boolean;
    } else if (word("null")) {
    } else {
      const std::size_t start = i_;
      if (t_[i_] == '-') ++i_;
      if (i_ >= t_.size() || !std::isdigit(static_cast<unsigned char>(t_[i_]))) fail("bad value");
      while (i_ < t_.size() && (std::isdigit(static_cast<unsigned char>(t_[i_])) ||
                                std::string(".eE+-").find(t_[i_]) != std::string::npos))
        ++i_;
      v.kind = value::number;
      v.n = std::strtod(t_.substr(start, i_ - start).c_str(), nullptr);
    }
    return v;
  }
  std::string str() {
    if (i_ >= t_.size() || t_[i_] != '"') fail("expected a string");
    ++i_;
    std::string out;
    while (i_ < t_.size() && t_[i_] != '"') {
      if (static_cast<unsigned char>(t_[i_]) < 0x20) fail("control character in a string");
      if (t_[i_] == '\\') {
        ++i_;
        if (i_ >= t_.size()) fail("unexpected end");
      }
      out += t_[i_++];
    }
    if (i_ >= t_.size()) fail("unterminated string");
    ++i_;
    return out;
  }

  const std::string& t_;
  std::size_t i_ = 0;
};

inline value parse(const std::string& text) { return parser(text).parse(); }

}  // namespace epmoe::test::json
