// The order in which the shared-memory collectives combine the ranks' terms of an
// element: Gloo's, so a pycomm group gives a Gloo group's bits at every world size.
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace pycomm::shm {

// Note [Gloo's summation order]
// A floating-point sum (or product) of three or more terms depends on their order. Gloo's
// ring all-reduce of a buffer of B bytes, W ranks, elements of e bytes, cuts it into
//   S = roundup(max(ceil(B / M), 2W), W) segments of s = roundup(ceil(B / S), e) bytes,
// M being 1 MiB rounded down to whole elements, and gives chunk c (segments c S/W to
// (c + 1) S/W - 1) to rank c. Its ring reduce (gloo::reduce) sizes the segments first,
//   s = roundup(min(ceil(B / 2W), M), e), then S = roundup(max(ceil(B / s), 2W), W),
// which gives the same chunks up to B = 2W M and slightly different ones past it. In both
// the partial sum of a chunk starts at rank c - 1 and goes down the ring, so each of its
// elements is ((x[c-1] + x[c-2]) + ... + x[c+1]) + x[c], ranks taken mod W. Which buffer
// an element sits in, and which ring, follows the Gloo operation the collective comes down
// to in ProcessGroupGloo:
//   all_reduce, all_reduce_coalesced (one flat buffer): the whole buffer, all-reduce ring;
//   reduce: the whole buffer, reduce ring;
//   reduce_scatter_tensor: the whole input, all-reduce ring (Gloo all-reduces it and keeps
//     its block);
//   reduce_scatter_tensor_coalesced: each entry's input on its own, all-reduce ring;
//   reduce_scatter of a list: each rank's output on its own, all-reduce ring.
// Measured against torch 2.13's Gloo at 3 and 4 ranks, 5 to 50 million elements;
// tests/shm/test_gloo_order.py holds it there. Before, the terms went in rank order, which
// rounds differently from three ranks on (FSDP2 on a pycomm group was within 1e-6 of FSDP2
// on Gloo, not equal). The order costs nothing: the kernels read the same sources, listed
// in another order, and a range is cut at most W - 1 times.
// What stays different: bfloat16 and float16 accumulate in float32 and round once
// (reduce_kernels.h), where Gloo rounds after every hop, so from three ranks on pycomm's
// low-precision sums are the more exact ones. MIN, MAX and the integer ops do not depend
// on the order.
constexpr size_t kGlooMaxSegmentBytes = 1024 * 1024;

// The ranks of one element's terms in the order they are combined: rank(k) comes k-th.
class RingTerms {
 public:
  RingTerms(int world, int chunk) : world_(world), chunk_(chunk) {}
  int rank(int k) const {
    return k == world_ - 1 ? chunk_ : ((chunk_ - 1 - k) % world_ + world_) % world_;
  }
  // srcs[k] = where the k-th term is: `own` for rank `self`, peer(p) for another rank p.
  template <typename Peer>
  void list(int self, const void* own, const Peer& peer, const void** srcs) const {
    for (int k = 0; k < world_; ++k) {
      const int p = rank(k);
      srcs[k] = p == self ? own : static_cast<const void*>(peer(p));
    }
  }
  // Where `r`'s term comes.
  int position(int r) const {
    return r == chunk_ ? world_ - 1 : ((chunk_ - 1 - r) % world_ + world_) % world_;
  }

 private:
  int world_, chunk_;
};

// Gloo's two rings, which cut a buffer past 2W MiB differently.
enum class GlooRing : uint8_t { kAllreduce, kReduce };

// The elements one call reduces, as stretches of the Gloo buffers they sit in.
class SumOrder {
 public:
  // All of one buffer of `n` elements.
  static SumOrder whole(int64_t n, GlooRing ring = GlooRing::kAllreduce) {
    return SumOrder().then(n, n, 0, ring);
  }
  // Rank `rank`'s block of a reduce_scatter_tensor of `n` elements per rank.
  static SumOrder scattered(int world, int rank, int64_t n) {
    return SumOrder().then(n, world * n, rank * n, GlooRing::kAllreduce);
  }
  // Append `len` elements that start at index `start` of a buffer of `total`.
  SumOrder& then(int64_t len, int64_t total, int64_t start, GlooRing ring) {
    spans_.push_back({len, total, start, ring});
    return *this;
  }

  // fn(lo, len, terms) over the call's elements [begin, begin + len), cut where the order
  // changes; lo counts from begin.
  template <typename F>
  void each(int world, size_t elem, int64_t begin, int64_t len, F&& fn) const {
    const int64_t end = begin + len;
    int64_t base = 0;  // index of the span's first element among the call's
    for (const Span& s : spans_) {
      const int64_t lo = std::max(begin, base), hi = std::min(end, base + s.len);
      for (int64_t at = lo; at < hi;) {
        const int64_t in_buffer = s.start + (at - base);
        const int64_t per_chunk = chunk_elements(world, elem, s.total, s.ring);
        const int64_t c = std::min<int64_t>(world - 1, in_buffer / per_chunk);
        const int64_t stop = c == world - 1 ? hi
                                            : std::min(hi, at + (c + 1) * per_chunk - in_buffer);
        fn(at - begin, stop - at, RingTerms(world, static_cast<int>(c)));
        at = stop;
      }
      base += s.len;
    }
    // Elements past the spans would be left out of the reduction, unsummed.
    TORCH_CHECK(end <= base, "pycomm: a reduction of elements up to ", end,
                " was given an order for ", base);
  }

 private:
  struct Span {
    int64_t len, total, start;
    GlooRing ring;
  };
  // Elements of one rank's chunk of Gloo's `ring` over `total` elements (at least 1).
  static int64_t chunk_elements(int world, size_t elem, int64_t total, GlooRing ring) {
    const size_t bytes = static_cast<size_t>(std::max<int64_t>(total, 1)) * elem;
    const size_t cap = elem * std::max<size_t>(1, kGlooMaxSegmentBytes / elem);
    const size_t min_segments = 2 * static_cast<size_t>(world);
    auto up = [](size_t v, size_t to) { return (v + to - 1) / to * to; };
    size_t segments, segment;
    if (ring == GlooRing::kAllreduce) {
      segments = up(std::max((bytes + cap - 1) / cap, min_segments), world);
      segment = up((bytes + segments - 1) / segments, elem);
    } else {
      segment = up(std::min((bytes + min_segments - 1) / min_segments, cap), elem);
      segments = up(std::max((bytes + segment - 1) / segment, min_segments), world);
    }
    return static_cast<int64_t>(segments / world * segment / elem);
  }
  c10::SmallVector<Span, 2> spans_;
};

}  // namespace pycomm::shm
