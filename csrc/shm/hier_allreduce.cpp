// The hierarchical all-reduce of HierBackend (see Note [Hierarchical all-reduce] and Note
// [Hierarchical pipeline], hier.h), with its low-precision wire (Note [Low-precision wire],
// wire_codec.h).
#include <ATen/Functions.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "shm/hier.h"
#include "shm/hier_phase.h"
#include "shm/reduce_kernels.h"
#include "shm/tensor_args.h"
#include "shm/wire_codec.h"

namespace pycomm::shm {

namespace {
// One hierarchical all-reduce (See Note [Hierarchical pipeline]): blocks of L
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

  // The all-reduce of a tensor, whose elements come in `flat`, or of pieces of one buffer
  // (Note [Hierarchical all-reduce of pieces]), in `pieces` scaled by `scale` as they are
  // read, `flat` then only a tensor of their dtype and count for its options. With a
  // low-precision `wire` (float32 and a sum), each block's piece crosses hosts as Note
  // [Low-precision wire] says, its error-feedback residuals in `residual`.
  BlockPipeline(Where where, at::Tensor flat, ShmBackend& local, c10d::Backend& cross,
                c10d::ReduceOp op, int64_t piece_bytes, comm::Wire wire = {},
                comm::WireResidual* residual = nullptr, const Pieces* pieces = nullptr,
                double scale = 1.0)
      : where_(where),
        flat_(std::move(flat)),
        pieces_(pieces),
        scale_(scale),
        local_(local),
        cross_(cross),
        op_(op),
        wire_(wire),
        n_(pieces_ ? static_cast<int64_t>(pieces_->bytes()) / flat_.element_size() : flat_.numel()),
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

  // Block b's elements of the tensor: [begin, begin + len).
  std::pair<int64_t, int64_t> range(int64_t b) const {
    const int64_t begin = b * block_max_;
    return {begin, std::min(block_max_, n_ - begin)};
  }

  // Elements [begin, begin + len) of the pieces, as pieces.
  Pieces slice(int64_t begin, int64_t len) const {
    Pieces part;
    const auto elem = static_cast<size_t>(flat_.element_size());
    pieces_->each(begin * elem, len * elem,
                  [&](char* data, size_t /*offset*/, size_t bytes) { part.add(data, bytes); });
    return part;
  }

  void reduce_within(int64_t b) {
    if (L_ == 1) return alone(b);
    Block& k = state_[b];
    const auto [begin, len] = range(b);
    const int64_t piece = (len + L_ - 1) / L_;
    const char* name = local_phase_names(wire_).first;
    k.mine = at::empty({piece}, flat_.options());
    if (pieces_ != nullptr && piece * L_ == len) {
      wait("the reduce-scatter within the host", b,
           local_.reduce_scatter_pieces_as(name, slice(begin, len), flat_.scalar_type(), scale_,
                                           k.mine));
      return cross_block(b);
    }
    if (pieces_ != nullptr) {  // a padded last block: the pieces scaled into a buffer
      k.whole = at::zeros({piece * L_}, flat_.options());
      char* to = static_cast<char*>(k.whole.data_ptr());
      slice(begin, len)
          .each(0, len * flat_.element_size(), [&](char* from, size_t at, size_t bytes) {
            scale_copy(flat_.scalar_type(), to + at, from,
                       static_cast<int64_t>(bytes) / flat_.element_size(), scale_);
          });
    } else {
      k.user = flat_.narrow(0, begin, len);
      k.whole = k.user;
      if (piece * L_ != len) {
        k.whole = at::zeros({piece * L_}, flat_.options());
        k.whole.narrow(0, 0, len).copy_(k.user);
      }
    }
    c10d::ReduceScatterOptions rs;
    rs.reduceOp = op_;
    wait("the reduce-scatter within the host", b,
         local_.reduce_scatter_tensor_as(name, k.mine, k.whole, rs));
    cross_block(b);
  }

  // Note [One rank per host]
  // With one rank per host there is nothing to combine within it: the shared-memory
  // reduce-scatter and all-gather of a block would only copy it there and back, and run
  // their rounds. So block b crosses hosts from the tensor itself, its sums landing there;
  // pieces are scaled into one buffer of the block as they are read (what the reduce-
  // scatter of pieces would do) and copied back once summed. The elements, their order
  // and every crossing stay the pipeline's: the same bits.
  void alone(int64_t b) {
    Block& k = state_[b];
    const auto [begin, len] = range(b);
    if (pieces_ == nullptr) {
      k.mine = flat_.narrow(0, begin, len);
      return cross_block(b);
    }
    k.mine = at::empty({len}, flat_.options());
    char* to = static_cast<char*>(k.mine.data_ptr());
    slice(begin, len).each(0, len * flat_.element_size(), [&](char* from, size_t at, size_t bytes) {
      scale_copy(flat_.scalar_type(), to + at, from,
                 static_cast<int64_t>(bytes) / flat_.element_size(), scale_);
    });
    cross_block(b);
  }

  // Block b's piece, reduced within the host, on its way across hosts.
  void cross_block(int64_t b) {
    Block& k = state_[b];
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
    if (L_ == 1) {  // See Note [One rank per host]: the sums are in the tensor, or in k.mine
      if (pieces_ != nullptr) copy_home(b, k.mine);
      k = Block{};
      return;
    }
    c10d::AllgatherOptions ag;
    // Pieces are gathered through a buffer of the block: the all-gather writes ranks'
    // pieces whole, the block's elements may span several tensors.
    if (pieces_ != nullptr && !k.whole.defined())
      k.whole = at::empty({k.mine.numel() * L_}, k.mine.options());
    wait("the all-gather within the host", b,
         local_.all_gather_tensor_as(local_phase_names(wire_).second, k.whole, k.mine, ag));
    if (pieces_ != nullptr) {
      copy_home(b, k.whole);
    } else if (!k.whole.is_same(k.user)) {
      k.user.copy_(k.whole.narrow(0, 0, k.user.numel()));
    }
    k = Block{};  // the block's buffers go as soon as it is done
  }

  // Block b's elements, from the front of `from`, back into the pieces.
  void copy_home(int64_t b, const at::Tensor& from) {
    const auto [begin, len] = range(b);
    const char* src = static_cast<const char*>(from.const_data_ptr());
    slice(begin, len).each(0, len * flat_.element_size(), [&](char* to, size_t at, size_t bytes) {
      std::memcpy(to, src + at, bytes);
    });
  }

  const Where where_;
  const at::Tensor flat_;
  const Pieces* const pieces_;  // what an all-reduce of pieces reduces, else null
  const double scale_;
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

comm::WorkPtr HierBackend::allreduce_wire(at::Tensor tensor, const comm::Wire& wire,
                                          std::shared_ptr<comm::WireResidual> residual) {
  const char* op = wire_op_name(wire);
  check_dense(op, tensor);
  check_wire(op, tensor, wire, residual != nullptr);
  return enqueue(op, c10d::OpType::ALLREDUCE, {tensor},
                 [this, op, tensor, wire, residual, piece = piece_bytes_](uint64_t seq) {
                   run(op, seq, piece, tensor, c10d::ReduceOp::SUM, wire, residual.get());
                 });
}

// Note [Hierarchical all-reduce of pieces]
// A DDP bucket reduced where its gradients are (Note [Gradients reduced in place] in
// reducer/in_place.cpp) over the hierarchy: each block's reduce-scatter within the host reads
// the block's elements from the gradients, scaled as they are read (reduce_scatter_pieces_as,
// the same collective as the buffer's), and its all-gather within the host lands in a buffer
// of the block, copied out into the gradients from cache. Against the bucket's path this
// saves the gradients' copy into the bucket and the bucket's copy back into param.grad, two
// passes over every gradient byte in memory per step. The blocks, their order and every
// crossing are the buffer's, so a rank whose bucket goes through its buffer and one whose
// goes in place add the same elements in the same order: the same bits.
comm::WorkPtr HierBackend::allreduce_pieces_wire(std::vector<at::Tensor> tensors, double scale,
                                                 const comm::Wire& wire,
                                                 std::shared_ptr<comm::WireResidual> residual) {
  const char* op = wire_op_name(wire);
  const c10::ScalarType dtype = check_pieces(op, tensors);
  if (!wire.exact()) {
    TORCH_CHECK_VALUE(dtype == at::kFloat, "pycomm ", op,
                      ": the low-precision wire reduces float32 pieces, got ", dtype);
    check_wire(op, tensors.front(), wire, residual != nullptr);
  }
  return enqueue(op, c10d::OpType::ALLREDUCE, tensors,
                 [this, op, tensors, scale, wire, residual, piece = piece_bytes_](uint64_t seq) {
                   Pieces pieces;
                   for (const auto& t : tensors) {
                     pieces.add(static_cast<char*>(t.data_ptr()), t.nbytes());
                   }
                   if (pieces.bytes() == 0) return;
                   std::unique_lock<std::mutex> lock;
                   if (residual) lock = std::unique_lock<std::mutex>(residual->mutex);
                   // a tensor of the pieces' dtype for the pipeline's buffers
                   at::Tensor like = at::empty({0}, tensors.front().options());
                   BlockPipeline({op, seq, rank_, host_, hosts_}, like, *local_, *cross_,
                                 c10d::ReduceOp(c10d::ReduceOp::SUM), piece, wire, residual.get(),
                                 &pieces, scale)
                       .run();
                 });
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
  // AVG: both stages sum, and the end divides once by the group's size.
  const bool average = reduce == c10d::ReduceOp::AVG;
  BlockPipeline({op, seq, rank_, host_, hosts_}, work, *local_, *cross_,
                c10d::ReduceOp(average ? c10d::ReduceOp::SUM : reduce), piece_bytes, wire, residual)
      .run();
  if (average) work.div_(size_);
  if (!work.is_same(flat)) flat.copy_(work);
  d.write_back();
}

}  // namespace pycomm::shm
