// A sharded optimizer's bucket reductions, kept in C++ (see shard_hook.h).
#include "reducer/shard_hook.h"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <utility>

#include "comm/shard_split.h"

namespace pycomm::reducer {

namespace py = pybind11;

namespace {

// Free `buffer`'s storage (release_storage); on a device, not before the current stream's
// work on it is done (the copies out of it were queued there).
void free_bucket(const at::Tensor& buffer) {
  if (!buffer.device().is_cpu()) {
    c10::impl::VirtualGuardImpl guard(buffer.device().type());
    guard.recordDataPtrOnStream(buffer.storage().data_ptr(), guard.getStream(buffer.device()));
  }
  release_storage(buffer);
}

// One future for `futures` (which fails with the first error), or the one.
FuturePtr all_of(std::vector<FuturePtr> futures) {
  if (futures.size() == 1) return futures.front();
  c10::List<FuturePtr> list(c10::FutureType::create(c10::AnyType::get()));
  for (auto& f : futures) list.push_back(std::move(f));
  return c10::collectAll(list);
}

// Rethrow the error of a finished future of collectAll's, or of any of its parts.
void raise_failure(c10::ivalue::Future& done) {
  if (done.hasError()) std::rethrow_exception(done.exception_ptr());
  const c10::IValue& value = done.value();
  if (!value.isList()) return;
  for (const auto& part : value.toListRef()) {
    if (part.isFuture()) part.toFuture()->value();
  }
}

}  // namespace

ShardKeep::ShardKeep(comm::ProcessGroupPtr pg, bool reduce_scatter, comm::Wire wire)
    : pg_(std::move(pg)),
      rank_(pg_->getRank()),
      world_(pg_->getSize()),
      reduce_scatter_(reduce_scatter),
      wire_(wire) {
  if (!wire_.exact()) {
    backend_ = comm::cpu_backend(pg_);
    wire_ops_ = comm::wire_collectives(backend_);
  }
}

std::pair<at::Tensor, bool> ShardKeep::kept(int64_t index, const at::Tensor& buffer) {
  const comm::ShardSplit split = comm::shard_split(buffer.numel(), world_);
  const int64_t numel = split.range + split.tail;
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = grads_.find(index);
  if (it == grads_.end() || it->second.numel() != numel ||
      it->second.scalar_type() != buffer.scalar_type()) {
    at::Tensor out = at::empty({numel}, buffer.options());
    grads_[index] = out;
    return {out, false};  // nothing kept to add to
  }
  return {it->second, fresh_.count(index) > 0};
}

FuturePtr ShardKeep::reduce_whole(const at::Tensor& buffer, const std::vector<size_t>& members,
                                  const std::vector<size_t>& lengths, bool release,
                                  std::shared_ptr<comm::WireResidual>& residual) {
  at::Tensor buf = buffer;
  comm::WorkPtr work;
  if (on_wire(buf)) {
    if (wire_.error_feedback && !residual) residual = std::make_shared<comm::WireResidual>();
    work = wire_ops_->allreduce_wire(buf, wire_, residual);
  } else {
    work = comm::start_allreduce(pg_, buf, c10d::ReduceOp::SUM);
  }
  return work->getFuture()->then(
      [this, self = shared_from_this(), buf, members, lengths, release](c10::ivalue::Future& done) {
        raise_failure(done);
        const at::Tensor flat = buf.view({-1});
        int64_t at = 0;
        {
          std::lock_guard<std::mutex> lock(mutex_);
          for (size_t slot = 0; slot < members.size(); ++slot) {
            const auto n = static_cast<int64_t>(lengths[slot]);
            at::Tensor run = flat.narrow(0, at, n);
            at += n;
            auto it = first_.find(static_cast<int64_t>(members[slot]));
            if (it != first_.end()) {
              it->second.add_(run);
            } else {
              first_.emplace(static_cast<int64_t>(members[slot]), run.clone());
            }
          }
        }
        if (release) free_bucket(buf);
        return c10::IValue(buf);
      },
      c10::TensorType::get());
}

FuturePtr ShardKeep::reduce(int64_t index, const at::Tensor& buffer,
                            const std::vector<size_t>& members, const std::vector<size_t>& lengths,
                            bool final, bool release,
                            std::shared_ptr<comm::WireResidual>& residual) {
  if (!final) return reduce_whole(buffer, members, lengths, release, residual);
  at::Tensor buf = buffer.view({-1});
  const comm::ShardSplit split = comm::shard_split(buf.numel(), world_);
  const int64_t tail_start = split.range * world_;
  at::Tensor mine = buf.narrow(0, split.range * rank_, split.range);
  at::Tensor tail = buf.narrow(0, tail_start, split.tail);
  auto [out, add] = kept(index, buf);
  // Unless it adds to what an earlier backward kept, or the bucket stays (not released: its
  // range must hold the average too), the reduce-scatter writes the range straight into
  // what the rank keeps: one pass over the range fewer than reducing in place and copying.
  const bool direct = reduce_scatter_ && release && !add;
  std::vector<FuturePtr> futures;
  if (reduce_scatter_) {
    at::Tensor range_out = direct ? out.narrow(0, 0, split.range) : mine;
    at::Tensor ranges = buf.narrow(0, 0, tail_start);
    if (split.range > 0 && on_wire(buf)) {
      if (wire_.error_feedback && !residual) residual = std::make_shared<comm::WireResidual>();
      futures.push_back(
          wire_ops_->reduce_scatter_wire(range_out, ranges, wire_, residual)->getFuture());
    } else if (split.range > 0) {
      futures.push_back(comm::start_reduce_scatter(pg_, range_out, ranges)->getFuture());
    }
    if (split.tail > 0) {  // fewer elements than ranks, in float32
      futures.push_back(comm::start_allreduce(pg_, tail, c10d::ReduceOp::SUM)->getFuture());
    }
  } else if (buf.numel() > 0) {
    futures.push_back(comm::start_allreduce(pg_, buf, c10d::ReduceOp::SUM)->getFuture());
  }
  auto keep = [this, self = shared_from_this(), index, whole = buffer, out = out, add = add, mine,
               tail, direct, release, shard = split.range]() {
    at::Tensor kept_tail = out.narrow(0, shard, out.numel() - shard);
    add ? kept_tail.add_(tail) : kept_tail.copy_(tail);
    if (!direct) {
      at::Tensor kept_mine = out.narrow(0, 0, shard);
      add ? kept_mine.add_(mine) : kept_mine.copy_(mine);
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      fresh_.insert(index);
    }
    if (release) free_bucket(whole);
    return c10::IValue(whole);
  };
  if (futures.empty()) {  // an empty bucket
    auto done = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
    done->markCompleted(keep());
    return done;
  }
  return all_of(std::move(futures))
      ->then(
          [keep](c10::ivalue::Future& done) {
            raise_failure(done);
            return keep();
          },
          c10::TensorType::get());
}

FuturePtr ShardKeep::reduce_in_place(int64_t index, const at::Tensor& buffer,
                                     std::vector<at::Tensor> grads, double scale,
                                     comm::BucketAllreduce& ops, const comm::OpLabel& label) {
  auto [out, add] = kept(index, buffer);
  at::Tensor into = add ? at::empty_like(out) : out;
  FuturePtr done = ops.reduce_scatter_pieces(std::move(grads), scale, into, label)->getFuture();
  return done->then(
      [this, self = shared_from_this(), index, whole = buffer, out = out, into,
       add = add](c10::ivalue::Future& parent) {
        raise_failure(parent);
        if (add) out.add_(into);
        {
          std::lock_guard<std::mutex> lock(mutex_);
          fresh_.insert(index);
        }
        free_bucket(whole);  // never filled once final; a re-cut bucket still has storage
        return c10::IValue(whole);
      },
      c10::TensorType::get());
}

std::map<int64_t, at::Tensor> ShardKeep::grads() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return grads_;
}

std::set<int64_t> ShardKeep::fresh() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return fresh_;
}

void ShardKeep::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  fresh_.clear();
  first_.clear();
}

void ShardKeep::drop(int64_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  grads_.erase(index);
  fresh_.erase(index);
}

std::map<int64_t, at::Tensor> ShardKeep::take_first() {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::exchange(first_, {});
}

bool ShardKeep::has_first() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return !first_.empty();
}

ShardHook::ShardHook(std::shared_ptr<ShardKeep> keep, bool final)
    : keep_(std::move(keep)), final_(final) {
  if (final_) {
    backend_ = comm::cpu_backend(keep_->process_group());
    bucket_ops_ = comm::bucket_allreduce(backend_);
  }
}

FuturePtr ShardHook::run(Bucket& bucket, size_t /*bucket_count*/,
                         const std::vector<at::Tensor>& /*params*/,
                         const comm::OpLabel& /*label*/) {
  return keep_->reduce(static_cast<int64_t>(bucket.index), bucket.buffer, bucket.params,
                       bucket.lengths, final_, releases(bucket.path), bucket.wire_residual);
}

FuturePtr ShardHook::run_in_place(Bucket& bucket, size_t /*bucket_count*/,
                                  const std::vector<at::Tensor>& /*params*/,
                                  std::vector<at::Tensor> grads, double scale,
                                  const comm::OpLabel& label) {
  TORCH_CHECK(bucket_ops_ != nullptr, "bucket ", bucket.index,
              ": in-place reduction needs a pycomm shared-memory group");
  return keep_->reduce_in_place(static_cast<int64_t>(bucket.index), bucket.buffer, std::move(grads),
                                scale, *bucket_ops_, label);
}

void bind_shard_keep(py::module_& m) {
  py::class_<ShardKeep, std::shared_ptr<ShardKeep>>(
      m, "ShardKeep",
      "What a ZeroRedundancyOptimizer releasing the gradients keeps of each bucket (See "
      "Note [Shards kept in C++] in csrc/reducer/shard_hook.h)")
      .def(py::init<comm::ProcessGroupPtr, bool, comm::Wire>(), py::arg("group"),
           py::arg("reduce_scatter"), py::arg("wire"))
      .def(
          "reduce",
          [](const std::shared_ptr<ShardKeep>& keep, int64_t index, const at::Tensor& buffer,
             const std::vector<size_t>& members, const std::vector<size_t>& lengths, bool final) {
            std::shared_ptr<comm::WireResidual> residual;  // zeros need no error feedback
            FuturePtr done;
            {
              py::gil_scoped_release nogil;
              done = keep->reduce(index, buffer, members, lengths, final, false, residual);
            }
            return torch::jit::toPyObject(c10::IValue(done));
          },
          py::arg("index"), py::arg("buffer"), py::arg("members"), py::arg("lengths"),
          py::arg("final"),
          "Reduce bucket `index` as the hook does, keeping its buffer (a joined rank's shadow "
          "of the running ranks' bucket: pycomm/ddp/join.py); a torch.futures.Future")
      .def_property_readonly("grads", &ShardKeep::grads,
                             "per bucket index, the kept range and tail (a new dict)")
      .def_property_readonly("fresh", &ShardKeep::fresh,
                             "the bucket indices reduced since clear() (a new set)")
      .def("clear", &ShardKeep::clear, "the optimizer's zero_grad: nothing reduced since")
      .def("drop", &ShardKeep::drop, py::arg("index"), "forget bucket `index`'s kept tensor")
      .def("take_first", &ShardKeep::take_first,
           "the whole gradients kept per parameter index before the re-cut, forgotten here")
      .def_property_readonly("has_first", &ShardKeep::has_first)
      .def_property_readonly("reduce_scatter", &ShardKeep::reduce_scatter,
                             "whether the ranges are reduce-scattered (else all-reduced)")
      .def_property_readonly(
          "wire",
          [](const ShardKeep& keep) -> std::optional<comm::Wire> {
            const comm::Wire* wire = keep.wire();
            return wire ? std::optional<comm::Wire>(*wire) : std::nullopt;
          },
          "the wire the buckets cross hosts in, or None for float32");
}

}  // namespace pycomm::reducer
