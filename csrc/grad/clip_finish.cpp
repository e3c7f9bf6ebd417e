// finish_clip, the one finish of every clip (See Note [One clip finish] in clip.h), and
// torch's words for a non-finite total norm.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <tuple>

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

ClipFinish finish_clip(const at::Tensor& partial, double max_norm, double norm_type,
                       bool error_if_nonfinite, at::ScalarType norm_dtype) {
  static auto clip_coef = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("pycomm::clip_coef", "")
                              .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, double,
                                                                        double, at::ScalarType)>();
  // Below autograd, as the composite (clip.cpp): clipping is not differentiable, and the
  // Autograd key's fallback for a pycomm op is boxed.
  c10::impl::ExcludeDispatchKeyGuard below_autograd(
      c10::autograd_dispatch_keyset_with_ADInplaceOrView);
  auto [total, coef] = clip_coef.call(partial, norm_type, max_norm, norm_dtype);
  TORCH_CHECK(!error_if_nonfinite || std::isfinite(total.item<double>()),
              nonfinite_norm_message(norm_type));
  return {std::move(total), std::move(coef)};
}

std::string nonfinite_norm_message(double norm_type) {
  return "The total norm of order " + python_float_repr(norm_type) +
         " for gradients from `parameters` is non-finite, so it cannot be clipped. To disable "
         "this error and scale the gradients by the non-finite norm anyway, set "
         "`error_if_nonfinite=False`";
}

}  // namespace pycomm
