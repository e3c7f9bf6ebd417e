// The recorded step (See Note [Bucket rebuild] in rebuild.h): its ready order, and which
// parameters' gradients become ready together, the gradient groups the one bucket rebuild
// keeps whole (see assign_buckets in bucket.h).
#include "reducer/rebuild.h"

#include <unordered_map>
#include <unordered_set>

namespace pycomm::reducer {

// Note [Gradient groups]
// The gradients one autograd node produces land together: its AccumulateGrad nodes run
// one after the other as soon as it finishes. In eager mode such a node produces one or
// two parameters' gradients (a LayerNorm's weight and bias). A compiled region's backward
// is one node for all the parameters of the region: under torch.compile, dynamo's
// DDPOptimizer splits the forward graph at bucket-sized pieces (see pycomm/ddp/compile.py)
// and each piece's backward delivers the gradients of its parameters in one burst, in an
// order of the engine's choosing. Cut by the ready order alone, a bucket can end inside a
// burst: the burst's remainder then waits in the next bucket for the next piece to
// finish, and the last piece leaves one more bucket, launched after backward:
//
//   backward:            [ piece 3 ........ ][ piece 2 ........ ][ piece 1 ........ ]
//   cut by ready order:   b0: most of 3       b1: rest of 3,      b2: rest of 2,       b3:
//                                             most of 2           most of 1        rest of 1
//   cut at burst ends:    b0: piece 3         b1: piece 2         b2: piece 1
//
// So the rebuild cuts inside a group only where both parts fill a bucket (a piece larger
// than two buckets: its parts are ready together anyway, and a first part can launch
// while the rest is copied).
//
// The recorded step (the one whose ready order seeds the rebuild) notes, for each
// parameter, the node its gradient comes from; a parameter reached from several nodes,
// or from none the outputs lead to (a reentrant checkpoint's nested backward), is a group
// of its own.
void RebuildRecorder::note_groups(const std::vector<at::Tensor>& outputs,
                                  const std::vector<AccumulatorPtr>& accumulators) {
  using torch::autograd::Node;
  std::unordered_map<const Node*, size_t> param_of;
  for (size_t i = 0; i < count_; ++i) param_of[accumulators[i].get()] = i;
  std::vector<const Node*> producer(count_, nullptr);
  std::vector<uint8_t> several(count_, 0);
  std::unordered_set<const Node*> seen;
  std::vector<Node*> stack;
  for (const auto& out : outputs) {
    if (!out.defined() || !out.requires_grad()) continue;
    auto edge = torch::autograd::impl::gradient_edge(out);
    if (edge.function && seen.insert(edge.function.get()).second) {
      stack.push_back(edge.function.get());
    }
  }
  while (!stack.empty()) {
    Node* node = stack.back();
    stack.pop_back();
    for (const auto& edge : node->next_edges()) {
      if (!edge.function) continue;
      auto found = param_of.find(edge.function.get());
      if (found != param_of.end()) {
        const size_t i = found->second;
        several[i] |= producer[i] != nullptr && producer[i] != node;
        producer[i] = node;
      }
      if (seen.insert(edge.function.get()).second) stack.push_back(edge.function.get());
    }
  }
  std::unordered_map<const Node*, int64_t> id_of;
  groups_.assign(count_, 0);
  int64_t next_id = 0;
  for (size_t i = 0; i < count_; ++i) {
    if (producer[i] == nullptr || several[i]) {
      groups_[i] = next_id++;
    } else {
      auto [it, inserted] = id_of.try_emplace(producer[i], next_id);
      if (inserted) ++next_id;
      groups_[i] = it->second;
    }
  }
}

std::vector<size_t> RebuildRecorder::ready_order() const {
  std::vector<uint8_t> seen(count_, 0);
  std::vector<size_t> order;
  for (size_t index : order_) {
    if (!seen[index]) order.push_back(index);
    seen[index] = 1;
  }
  for (size_t i = count_; i-- > 0;) {
    if (!seen[i]) order.push_back(i);
  }
  return order;
}

std::vector<int64_t> RebuildRecorder::ready_groups() const {
  if (!groups_.empty()) return groups_;
  std::vector<int64_t> alone(count_);
  for (size_t i = 0; i < alone.size(); ++i) alone[i] = static_cast<int64_t>(i);
  return alone;
}

}  // namespace pycomm::reducer
