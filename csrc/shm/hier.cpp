// The hierarchical all-reduce of HierBackend (see Note [Hierarchical all-reduce], hier.h).
#include "shm/hier.h"

#include <ATen/Functions.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "shm/reduce_kernels.h"
#include "shm/tensor_args.h"
#include "shm/wire_codec.h"

namespace pycomm::shm {

namespace {
// Wait for one phase of a hierarchical operation; a failure names the operation (with
// `detail`, e.g. the block), the rank's place in the hierarchy and the phase.
void wait_phase(const char* op, uint64_t seq, const std::string& detail, int rank, int host,
                int hosts, const c10d::Backend& local, const char* what,
                const c10::intrusive_ptr<c10d::Work>& w) {
  try {
    w->wait();
  } catch (const std::exception& e) {
    std::string why = e.what();
    if (auto* c = dynamic_cast<const c10::Error*>(&e)) why = c->what_without_backtrace();
    TORCH_CHECK_WITH(DistBackendError, false, "pycomm ", op, " #", seq, " (hierarchical", detail,
                     ") on rank ", rank, " (host ", host, " of ", hosts, ", local rank ",
                     local.getRank(), " of ", local.getSize(), "): ", what, " failed: ", why);
  }
}

// The names the shared-memory phases of a hierarchical all-reduce carry in errors and the
// flight record: the plain operations', or with the wire the all-reduce crosses hosts in.
std::pair<const char*, const char*> local_phase_names(const comm::Wire& wire) {
  switch (wire.dtype) {
    case comm::WireDtype::kFloat32: return {"reduce_scatter_tensor", "all_gather_into_tensor"};
    case comm::WireDtype::kBFloat16:
      return {"reduce_scatter_tensor[wire=bf16]", "all_gather_into_tensor[wire=bf16]"};
    case comm::WireDtype::kInt8:
      return wire.error_feedback ? std::make_pair("reduce_scatter_tensor[wire=int8+ef]",
                                                  "all_gather_into_tensor[wire=int8+ef]")
                                 : std::make_pair("reduce_scatter_tensor[wire=int8]",
                                                  "all_gather_into_tensor[wire=int8]");
  }
  return {"reduce_scatter_tensor", "all_gather_into_tensor"};
}

// One hierarchical all-reduce of `flat` (See Note [Hierarchical pipeline]): blocks of L
// pieces, each reduce-scattered within the host, its piece all-reduced across hosts on
// Gloo's threads while the next block is reduce-scattered, then all-gathered within the
// host. Every rank takes the same steps in the same order (they depend on n and L only),
// so the host's shared-memory rounds and the Gloo collectives match across ranks.
class BlockPipeline {
 public:
  struct Where {  // what a failure names
    const char* op;
    uint64_t seq;
    int rank, host, hosts;
  };

  // With a low-precision `wire` (a float32 tensor and a sum), each block's piece crosses
  // hosts as Note [Low-precision wire] says, its error-feedback residuals in `residual`.
  BlockPipeline(Where where, at::Tensor flat, ShmBackend& local, c10d::Backend& cross,
                c10d::ReduceOp op, int64_t piece_bytes, comm::Wire wire = {},
                comm::WireResidual* residual = nullptr)
      : where_(where),
        flat_(std::move(flat)),
        local_(local),
        cross_(cross),
        op_(op),
        wire_(wire),
        n_(flat_.numel()),
        L_(local.getSize()),
        H_(cross.getSize()),
        // The last block may be shorter, and is padded to a multiple of L in a buffer of
        // its own.
        block_max_(std::max<int64_t>(1, piece_bytes / flat_.element_size()) * L_),
        blocks_((n_ + block_max_ - 1) / block_max_),
        state_(blocks_) {
    if (!wire_.exact() && wire_.error_feedback) {
      // Block b's piece starts at b x piece_max of the rank's residual, its owned chunk at
      // b x chunk_max of the sums' residual.
      const int64_t piece_max = block_max_ / L_, chunk_max = (piece_max + H_ - 1) / H_;
      const auto options = flat_.options().dtype(at::kFloat);
      std::vector<int64_t> layout{blocks_, piece_max, L_, H_};
      if (residual->layout != layout) {  // another tensor size, piece or group shape
        residual->sent = at::zeros({blocks_ * piece_max}, options);
        residual->summed = at::zeros({blocks_ * chunk_max}, options);
        residual->layout = std::move(layout);
      }
      sent_residual_ = residual->sent.data_ptr<float>();
      summed_residual_ = residual->summed.data_ptr<float>();
    }
  }

  // Three stages with a low-precision wire (the all-to-all's sums, then the all-gather, are
  // a block's two crossings), two without; block b+1's reduce-scatter within the host
  // runs while block b crosses.
  void run() {
    const int64_t lag = wire_.exact() ? 1 : 2;
    for (int64_t b = 0; b < blocks_; ++b) {
      reduce_within(b);
      if (!wire_.exact() && b > 0) sum_across(b - 1);
      if (b >= lag) gather_within(b - lag);
    }
    if (!wire_.exact()) sum_across(blocks_ - 1);
    for (int64_t b = std::max<int64_t>(0, blocks_ - lag); b < blocks_; ++b) gather_within(b);
  }

 private:
  struct Block {
    at::Tensor whole;  // L x piece elements: a view of the tensor, or a padded copy
    at::Tensor mine;   // this rank's piece, reduced within the host, then across hosts
    at::Tensor user;   // the tensor's elements of this block (copied back when padded)
    c10::intrusive_ptr<c10d::Work> across;
    // With a low-precision wire: the H chunks' encodings (sent, then received), the
    // owned chunk's encoded sum, and every chunk's (gathered).
    at::Tensor sent, received, sum, gathered;
  };

  // Chunk h of a piece of `piece` elements: [h x q, h x q + chunk_len(h)), q = ceil(piece/H).
  int64_t chunk(int64_t piece) const { return (piece + H_ - 1) / H_; }
  int64_t chunk_len(int64_t piece, int64_t h) const {
    return std::clamp<int64_t>(piece - h * chunk(piece), 0, chunk(piece));
  }

  void wait(const char* what, int64_t block, const c10::intrusive_ptr<c10d::Work>& w) const {
    wait_phase(where_.op, where_.seq,
               c10::str(", ", n_, " elements, block ", block, " of ", blocks_), where_.rank,
               where_.host, where_.hosts, local_, what, w);
  }

  void reduce_within(int64_t b) {
    Block& k = state_[b];
    const int64_t begin = b * block_max_, len = std::min(block_max_, n_ - begin);
    const int64_t piece = (len + L_ - 1) / L_;
    k.user = flat_.narrow(0, begin, len);
    k.whole = k.user;
    if (piece * L_ != len) {
      k.whole = at::zeros({piece * L_}, flat_.options());
      k.whole.narrow(0, 0, len).copy_(k.user);
    }
    k.mine = at::empty({piece}, flat_.options());
    c10d::ReduceScatterOptions rs;
    rs.reduceOp = op_;
    wait("the reduce-scatter within the host", b,
         local_.reduce_scatter_tensor_as(local_phase_names(wire_).first, k.mine, k.whole, rs));
    if (!wire_.exact()) return send_across(b);
    std::vector<at::Tensor> across{k.mine};
    c10d::AllreduceOptions ar;
    ar.reduceOp = op_;
    k.across = cross_.allreduce(across, ar);  // runs on Gloo's threads meanwhile
  }

  // Note [Low-precision wire], step 1: the piece's H chunks encoded, all-to-all.
  void send_across(int64_t b) {
    Block& k = state_[b];
    const int64_t piece = k.mine.numel(), q = chunk(piece);
    const int64_t slot = wire_bytes(wire_.dtype, q);
    const auto bytes = k.mine.options().dtype(at::kByte);
    k.sent = at::empty({H_ * slot}, bytes);
    k.received = at::empty({H_ * slot}, bytes);
    const float* mine = k.mine.const_data_ptr<float>();
    uint8_t* sent = k.sent.data_ptr<uint8_t>();
    for (int64_t h = 0; h < H_ && h * q < piece; ++h) {  // chunks past the piece are empty
      float* residual = sent_residual_ ? sent_residual_ + b * (block_max_ / L_) + h * q : nullptr;
      wire_encode(wire_.dtype, mine + h * q, chunk_len(piece, h), sent + h * slot, residual);
    }
    std::vector<int64_t> equal;  // empty splits: equal ones
    c10d::AllToAllOptions a2a;
    k.across = cross_.alltoall_base(k.received, k.sent, equal, equal, a2a);
  }

  // Steps 2 and 3: the owned chunk's H encodings summed in float32 in host order, the sum
  // encoded once and all-gathered.
  void sum_across(int64_t b) {
    Block& k = state_[b];
    wait("the all-to-all across hosts", b, k.across);
    const int64_t piece = k.mine.numel(), q = chunk(piece);
    const int64_t slot = wire_bytes(wire_.dtype, q), me = cross_.getRank();
    const int64_t len = chunk_len(piece, me);
    at::Tensor acc = at::empty({len}, k.mine.options());
    const uint8_t* received = k.received.const_data_ptr<uint8_t>();
    for (int64_t h = 0; h < H_; ++h) {
      wire_decode(wire_.dtype, received + h * slot, len, acc.data_ptr<float>(), /*add=*/h > 0);
    }
    k.sent = k.received = at::Tensor();
    k.sum = at::empty({slot}, k.mine.options().dtype(at::kByte));
    float* residual = summed_residual_ ? summed_residual_ + b * chunk(block_max_ / L_) : nullptr;
    wire_encode(wire_.dtype, acc.const_data_ptr<float>(), len, k.sum.data_ptr<uint8_t>(), residual);
    k.gathered = at::empty({H_ * slot}, k.sum.options());
    c10d::AllgatherOptions ag;
    k.across = cross_._allgather_base(k.gathered, k.sum, ag);
  }

  void gather_within(int64_t b) {
    Block& k = state_[b];
    wait(wire_.exact() ? "the all-reduce across hosts" : "the all-gather across hosts", b,
         k.across);
    if (!wire_.exact()) {  // every chunk's sum decoded from the same bytes on every rank
      const int64_t piece = k.mine.numel(), q = chunk(piece);
      const int64_t slot = wire_bytes(wire_.dtype, q);
      const uint8_t* gathered = k.gathered.const_data_ptr<uint8_t>();
      float* mine = k.mine.data_ptr<float>();
      for (int64_t h = 0; h < H_ && h * q < piece; ++h) {
        wire_decode(wire_.dtype, gathered + h * slot, chunk_len(piece, h), mine + h * q,
                    /*add=*/false);
      }
    }
    c10d::AllgatherOptions ag;
    wait("the all-gather within the host", b,
         local_.all_gather_tensor_as(local_phase_names(wire_).second, k.whole, k.mine, ag));
    if (!k.whole.is_same(k.user)) k.user.copy_(k.whole.narrow(0, 0, k.user.numel()));
    k = Block{};  // the block's buffers go as soon as it is done
  }

  const Where where_;
  const at::Tensor flat_;
  ShmBackend& local_;
  c10d::Backend& cross_;
  const c10d::ReduceOp op_;
  const comm::Wire wire_;
  const int64_t n_, L_, H_, block_max_, blocks_;
  std::vector<Block> state_;
  float* sent_residual_ = nullptr;    // error feedback, when on (Note [Low-precision wire])
  float* summed_residual_ = nullptr;
};

}  // namespace

HierBackend::HierBackend(int rank, int size, int host, std::vector<std::vector<int>> ranks,
                         c10::intrusive_ptr<ShmBackend> local,
                         c10::intrusive_ptr<c10d::Backend> cross,
                         c10::intrusive_ptr<c10d::Backend> flat)
    : c10d::Backend(rank, size),
      host_(host),
      hosts_(static_cast<int>(ranks.size())),
      ranks_(std::move(ranks)),
      local_(std::move(local)),
      cross_(std::move(cross)),
      flat_(std::move(flat)),
      lane_(std::make_shared<Executor>()) {
  TORCH_CHECK_VALUE(local_ && cross_ && flat_, "pycomm hierarchical group: a sub-group is null");
  TORCH_CHECK_VALUE(local_->getSize() * hosts_ == size && cross_->getSize() == hosts_ &&
                        flat_->getSize() == size,
                    "pycomm hierarchical group: ", hosts_, " hosts of ", local_->getSize(),
                    " ranks do not make a group of ", size, " (cross group ", cross_->getSize(),
                    ", flat group ", flat_->getSize(), ")");
  std::vector<bool> seen(size, false);
  for (const auto& host_ranks : ranks_) {
    TORCH_CHECK_VALUE(static_cast<int64_t>(host_ranks.size()) == local_->getSize(),
                      "pycomm hierarchical group: every host needs ", local_->getSize(),
                      " ranks, one has ", host_ranks.size());
    for (int r : host_ranks) {
      TORCH_CHECK_VALUE(r >= 0 && r < size && !seen[r], "pycomm hierarchical group: rank ", r,
                        " is out of range or on two hosts");
      seen[r] = true;
    }
  }
  TORCH_CHECK_VALUE(host_ >= 0 && host_ < hosts_ && ranks_[host_][local_->getRank()] == rank,
                    "pycomm hierarchical group: rank ", rank, " is not local rank ",
                    local_->getRank(), " of host ", host_);
}

HierBackend::~HierBackend() { lane_->shutdown(); }

c10::intrusive_ptr<c10d::Work> HierBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                      const c10d::AllreduceOptions& opts) {
  const at::Tensor& t = single("all_reduce", tensors);
  check_reduction("all_reduce", t.scalar_type(), opts.reduceOp);
  const auto reduce = opts.reduceOp.op_;
  return enqueue("all_reduce", c10d::OpType::ALLREDUCE, {t},
                 [this, t, reduce, piece = piece_bytes_](uint64_t seq) {
                   run("all_reduce", seq, piece, t, reduce);
                 });
}

namespace {
// The operation's name in errors and records: which wire it ran with.
const char* wire_op_name(const comm::Wire& wire) {
  switch (wire.dtype) {
    case comm::WireDtype::kFloat32: return "all_reduce";
    case comm::WireDtype::kBFloat16: return "all_reduce[wire=bf16]";
    case comm::WireDtype::kInt8:
      return wire.error_feedback ? "all_reduce[wire=int8+ef]" : "all_reduce[wire=int8]";
  }
  return "all_reduce";
}
}  // namespace

comm::WorkPtr HierBackend::allreduce_wire(at::Tensor tensor, const comm::Wire& wire,
                                          std::shared_ptr<comm::WireResidual> residual) {
  const char* op = wire_op_name(wire);
  check_dense(op, tensor);
  const auto dtype = tensor.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, "pycomm ",
                    op, ": the low-precision wire takes float32, bfloat16 or float16 tensors, got ",
                    dtype);
  TORCH_CHECK_VALUE(!wire.error_feedback || residual, "pycomm ", op,
                    ": error feedback needs a residual to keep");
  return enqueue(op, c10d::OpType::ALLREDUCE, {tensor},
                 [this, op, tensor, wire, residual, piece = piece_bytes_](uint64_t seq) {
                   run(op, seq, piece, tensor, c10d::ReduceOp::SUM, wire, residual.get());
                 });
}

c10::intrusive_ptr<c10d::Work> HierBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  for (const auto& t : tensors) {
    check_dense("all_reduce_coalesced", t);
    check_reduction("all_reduce_coalesced", t.scalar_type(), opts.reduceOp);
  }
  const auto reduce = opts.reduceOp.op_;
  return enqueue("all_reduce_coalesced", c10d::OpType::ALLREDUCE_COALESCED, tensors,
                 [this, tensors, reduce, piece = piece_bytes_](uint64_t seq) {
                   // See Note [Coalesced all-reduce] in tensor_args.h
                   reduce_coalesced(tensors, [&](const at::Tensor& flat) {
                     run("all_reduce_coalesced", seq, piece, flat, reduce);
                   });
                 });
}

c10::intrusive_ptr<c10d::Work> HierBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  check_dense("reduce_scatter_tensor", output);
  check_like("reduce_scatter_tensor", input, output, output.numel() * size_);
  check_reduction("reduce_scatter_tensor", output.scalar_type(), opts.reduceOp);
  const auto reduce = opts.reduceOp.op_;
  return enqueue("reduce_scatter_tensor", c10d::OpType::_REDUCE_SCATTER_BASE, {output},
                 [this, output, input, reduce, piece = piece_bytes_](uint64_t seq) {
                   reduce_scatter_tensor(seq, piece, output, input, reduce);
                 });
}

c10::intrusive_ptr<c10d::Work> HierBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                            const c10d::AllgatherOptions& opts) {
  check_dense("all_gather_into_tensor", input);
  check_like("all_gather_into_tensor", output, input, input.numel() * size_);
  return enqueue("all_gather_into_tensor", c10d::OpType::_ALLGATHER_BASE, {output},
                 [this, output, input, piece = piece_bytes_](uint64_t seq) {
                   all_gather_tensor(seq, piece, output, input);
                 });
}

c10::intrusive_ptr<c10d::Work> HierBackend::enqueue(const char* op, c10d::OpType type,
                                                    std::vector<at::Tensor> outputs,
                                                    std::function<void(uint64_t seq)> body) {
  auto work = c10::make_intrusive<ShmWork>(rank_, type, outputs, lane_);
  uint64_t seq = next_seq_++;
  lane_->submit(work, [this, op, seq, body = std::move(body)] {
    {
      std::lock_guard<std::mutex> lock(failure_mutex_);
      TORCH_CHECK_WITH(DistBackendError, failure_.empty(), "pycomm ", op, " #", seq, " on rank ",
                       rank_, ": the group is unusable after an earlier failure: ", failure_);
    }
    try {
      body(seq);
    } catch (const std::exception& e) {
      std::string what = e.what();
      if (auto* c = dynamic_cast<const c10::Error*>(&e)) what = c->what_without_backtrace();
      std::lock_guard<std::mutex> lock(failure_mutex_);
      if (failure_.empty()) failure_ = what;
      throw;
    }
  });
  return work;
}

void HierBackend::set_piece_bytes(int64_t bytes) {
  TORCH_CHECK_VALUE(bytes > 0, "pycomm hierarchical group: piece_bytes must be positive, got ",
                    bytes);
  piece_bytes_ = bytes;
}

void HierBackend::run(const char* op, uint64_t seq, int64_t piece_bytes, const at::Tensor& t,
                      c10d::ReduceOp::RedOpType reduce, comm::Wire wire,
                      comm::WireResidual* residual) {
  Dense d(t);
  if (d.work.numel() == 0) return;
  at::Tensor flat = d.work.view({-1});
  // The low-precision wire encodes from and sums into float32 (Note [Low-precision wire]).
  at::Tensor work = wire.exact() ? flat : flat.to(at::kFloat);
  std::unique_lock<std::mutex> lock;
  if (residual) lock = std::unique_lock<std::mutex>(residual->mutex);
  // Gloo has no AVG: sum in both stages, divide once at the end.
  const bool average = reduce == c10d::ReduceOp::AVG;
  BlockPipeline({op, seq, rank_, host_, hosts_}, work, *local_, *cross_,
                c10d::ReduceOp(average ? c10d::ReduceOp::SUM : reduce), piece_bytes, wire, residual)
      .run();
  if (average) work.div_(size_);
  if (!work.is_same(flat)) flat.copy_(work);
  d.write_back();
}

void HierBackend::permute(const at::Tensor& group_order, const at::Tensor& chunk_order, int64_t s,
                          int64_t begin, int64_t len, bool to_chunks) const {
  const int64_t L = local_->getSize();
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t h = 0; h < hosts_; ++h) {
      at::Tensor chunk = chunk_order.narrow(0, (l * hosts_ + h) * len, len);
      at::Tensor range = group_order.narrow(0, ranks_[h][l] * s + begin, len);
      to_chunks ? chunk.copy_(range) : range.copy_(chunk);
    }
  }
}

namespace {

// The blocks of the tensor forms' pipelines (Note [Hierarchical reduce-scatter and
// all-gather]): block j is elements [begin(j), begin(j) + len(j)) of every rank's range of
// s elements, one piece each; `data` is what crosses hosts or came across, `across` the
// cross-host collective in flight.
struct RangeBlocks {
  struct Block {
    at::Tensor data;
    c10::intrusive_ptr<c10d::Work> across;
  };

  RangeBlocks(int64_t s, int64_t piece_bytes, const at::Tensor& t)
      : s(s),
        c(std::max<int64_t>(1, piece_bytes / t.element_size())),
        count((s + c - 1) / c),
        state(count) {}

  int64_t begin(int64_t j) const { return j * c; }
  int64_t len(int64_t j) const { return std::min(c, s - j * c); }
  std::string detail(int64_t j) const {
    return c10::str(", ", s, " elements per rank, block ", j, " of ", count);
  }

  const int64_t s, c, count;
  std::vector<Block> state;
};

}  // namespace

void HierBackend::reduce_scatter_tensor(uint64_t seq, int64_t piece_bytes, const at::Tensor& output,
                                        const at::Tensor& input, c10d::ReduceOp::RedOpType reduce) {
  const char* op = "reduce_scatter_tensor";
  const int64_t s = output.numel(), H = hosts_, L = local_->getSize();
  if (s == 0) return;
  RangeBlocks blocks(s, piece_bytes, output);
  const at::Tensor in = input.contiguous().view({-1});
  Dense out(output);
  char* result = static_cast<char*>(out.work.data_ptr());
  // Gloo has no AVG, so both stages sum and the last divides.
  const bool average = reduce == c10d::ReduceOp::AVG;
  c10d::ReduceScatterOptions rs;
  rs.reduceOp = c10d::ReduceOp(average ? c10d::ReduceOp::SUM : reduce);
  // Block j: into the chunk order (a copy: the output may be the rank's own range of the
  // input), reduce-scattered within the host, then across hosts on Gloo's threads: range
  // h of `mine` goes to host h, this rank's range comes back from each (into `data`).
  auto within = [&](int64_t j) {
    const int64_t len = blocks.len(j);
    at::Tensor chunks = at::empty({L * H * len}, in.options());
    permute(in, chunks, s, blocks.begin(j), len, /*to_chunks=*/true);
    at::Tensor mine = at::empty({H * len}, in.options());
    wait_phase(op, seq, blocks.detail(j), rank_, host_, hosts_, *local_,
               "the reduce-scatter within the host",
               local_->_reduce_scatter_base(mine, chunks, rs));
    auto& k = blocks.state[j];
    k.data = at::empty({H * len}, in.options());
    std::vector<int64_t> equal;  // empty splits: equal ones
    c10d::AllToAllOptions a2a;
    k.across = cross_->alltoall_base(k.data, mine, equal, equal, a2a);
  };
  // Block j's H ranges summed in host order into the output.
  auto finish = [&](int64_t j) {
    auto& k = blocks.state[j];
    const int64_t len = blocks.len(j);
    wait_phase(op, seq, blocks.detail(j), rank_, host_, hosts_, *local_,
               "the all-to-all across hosts", k.across);
    std::vector<const void*> srcs;
    for (int64_t h = 0; h < H; ++h) srcs.push_back(k.data.narrow(0, h * len, len).const_data_ptr());
    reduce_buffers(output.scalar_type(), reduce, result + blocks.begin(j) * output.element_size(),
                   srcs.data(), static_cast<int>(H), len, size_);
    k = {};
  };
  for (int64_t j = 0; j < blocks.count; ++j) {
    within(j);
    if (j > 0) finish(j - 1);
  }
  finish(blocks.count - 1);
  out.write_back();
}

void HierBackend::all_gather_tensor(uint64_t seq, int64_t piece_bytes, const at::Tensor& output,
                                    const at::Tensor& input) {
  const char* op = "all_gather_into_tensor";
  const int64_t s = input.numel(), H = hosts_, L = local_->getSize();
  if (s == 0) return;
  RangeBlocks blocks(s, piece_bytes, input);
  const at::Tensor in = input.contiguous().view({-1});
  Dense out(output);
  const at::Tensor home = out.work.view({-1});
  // Block j across hosts first, on Gloo's threads, into chunk l of this host (`data`: block
  // j of ranks[0][l], ..., ranks[H-1][l]).
  auto cross = [&](int64_t j) {
    auto& k = blocks.state[j];
    k.data = at::empty({H * blocks.len(j)}, in.options());
    at::Tensor part = in.narrow(0, blocks.begin(j), blocks.len(j));
    c10d::AllgatherOptions ag;
    k.across = cross_->_allgather_base(k.data, part, ag);
  };
  // Then within the host, and the ranges home.
  auto within = [&](int64_t j) {
    auto& k = blocks.state[j];
    wait_phase(op, seq, blocks.detail(j), rank_, host_, hosts_, *local_,
               "the all-gather across hosts", k.across);
    at::Tensor chunks = at::empty({L * H * blocks.len(j)}, in.options());
    c10d::AllgatherOptions ag;
    wait_phase(op, seq, blocks.detail(j), rank_, host_, hosts_, *local_,
               "the all-gather within the host", local_->_allgather_base(chunks, k.data, ag));
    permute(home, chunks, s, blocks.begin(j), blocks.len(j), /*to_chunks=*/false);
    k = {};
  };
  cross(0);
  for (int64_t j = 0; j < blocks.count; ++j) {
    if (j + 1 < blocks.count) cross(j + 1);
    within(j);
  }
  out.write_back();
}

}  // namespace pycomm::shm
