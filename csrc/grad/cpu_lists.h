// The CPU passes over a span list (span_list.h) behind the fused list ops, shared by the
// op kernels (grad_cpu.cpp) and the eager clip path that builds its span list straight from
// the parameters (clip_params_cpu in clip_bind.cpp). Fixed-size chunks of the virtual
// concatenation, so results do not depend on the thread count.
#pragma once

#include <c10/core/ScalarType.h>

#include "grad/grad_math.h"
#include "grad/span_list.h"

namespace pycomm {

// The norm partial of every element of `l` (See Note [Norm partials]): out[0] = acc,
// out[1] = 1 when an element is inf or nan, else 0. Not rounded to the partial's dtype.
void norm_partial_spans(const SpanList& l, NormKind kind, double p, double out[2]);

// x *= c over every element of `l`. The caller skips c == 1.
void scale_spans(const SpanList& l, double c);

}  // namespace pycomm
