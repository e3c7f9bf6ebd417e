// How a clip ends: torch's words for a non-finite total norm under error_if_nonfinite,
// which every clip's refusal raises (the composite's and the eager path's through
// check_total_finite in clip.cpp, the local clip's in its collective refusal).
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "grad/clip.h"

namespace pycomm {
namespace {

// x as Python's repr(float) writes it, which torch's message uses (an f-string of
// float(norm_type)): the shortest digits that read back as x, positional for decimal
// exponents -4 to 15 with at least one digit after the point ("2.0", "0.0001"), else
// d[.ddd]e+XX ("1e-05", "1e+16"). C++ streams 2.0 as "2".
std::string python_float_repr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[32];  // a double's shortest scientific form takes at most 24
  const auto written = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::scientific);
  const std::string s(buf, written.ptr);  // [-]d[.ddd]e(+|-)XX
  const size_t e = s.find('e');
  const int exp = std::atoi(s.c_str() + e + 1);
  const std::string sign = s[0] == '-' ? "-" : "";
  std::string digits;
  for (size_t i = sign.size(); i < e; ++i)
    if (s[i] != '.') digits += s[i];
  if (exp < -4 || exp >= 16) {
    char tail[16];
    std::snprintf(tail, sizeof tail, "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    return sign + digits.substr(0, 1) + (digits.size() > 1 ? "." + digits.substr(1) : "") + tail;
  }
  if (exp < 0) return sign + "0." + std::string(-exp - 1, '0') + digits;
  const size_t point = static_cast<size_t>(exp) + 1;
  if (digits.size() <= point) return sign + digits + std::string(point - digits.size(), '0') + ".0";
  return sign + digits.substr(0, point) + "." + digits.substr(point);
}

}  // namespace

std::string nonfinite_norm_message(double norm_type) {
  return "The total norm of order " + python_float_repr(norm_type) +
         " for gradients from `parameters` is non-finite, so it cannot be clipped. To disable "
         "this error and scale the gradients by the non-finite norm anyway, set "
         "`error_if_nonfinite=False`";
}

}  // namespace pycomm
