// fp32 main gradients of low-precision parameters (grad_reduce_dtype): which parameters'
// bucket views are wider than the parameter, and which views hold an unreduced local sum.
// Owns those two flags per parameter (See Note [main_grad accumulation] in main_grad.cpp).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "reducer/bucket.h"

namespace pycomm::reducer {

class MainGrads {
 public:
  // After each bucket layout: which parameters are widened; no sums pending.
  void reset(const BucketLayout& layout, const std::vector<at::Tensor>& params);
  bool widened(size_t index) const { return widened_[index] != 0; }
  // A gradient hook of a widened parameter: move param.grad into its view (`name` for
  // errors) and free it.
  void accumulate(size_t index, const at::Tensor& param, const at::Tensor& view,
                  const std::string& name);
  // At the synchronized step's copy into the bucket: whether the view held a local sum
  // (it is then the bucket slot's content; the sum restarts).
  bool take(size_t index) {
    if (!accumulated_[index]) return false;
    accumulated_[index] = 0;
    return true;
  }
  // Across a new bucket layout: the pending sums, saved before and restored after.
  std::vector<std::pair<size_t, at::Tensor>> save(const BucketLayout& layout) const;
  void restore(const BucketLayout& layout, const std::vector<std::pair<size_t, at::Tensor>>& sums);

 private:
  std::vector<uint8_t> widened_;      // the param's bucket is wider than the param
  std::vector<uint8_t> accumulated_;  // its bucket view holds an unreduced local sum
};

}  // namespace pycomm::reducer
