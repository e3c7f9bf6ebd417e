"""The reducer's streamed gradient copies (Note [Streaming copies] in
csrc/reducer/stream_copy.cpp): bitwise what ATen's mul_out / copy_ give, or not applied."""

import pytest
import torch

from pycomm import _C

MIN = _C._STREAM_COPY_MIN_BYTES // 4  # elements


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("scale", [None, 0.5, 1 / 3, 1 / 7])
@pytest.mark.parametrize("numel", [MIN, MIN + 1, 4 * MIN + 13, 1 << 22])
@pytest.mark.parametrize("offsets", [(0, 0), (1, 3), (3, 2)])
def test_bitwise_equal_to_aten_at_unaligned_offsets(threads, scale, numel, offsets):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(numel)
        src = torch.randn(numel + 8)[offsets[0]:offsets[0] + numel]
        dst = torch.full((numel + 8,), float("nan"))
        out = dst[offsets[1]:offsets[1] + numel]
        assert _C._stream_copy(out, src, scale)
        # ATen's reducer arithmetic: a float32 tensor times a double scalar (wrapped)
        want = src.clone() if scale is None else torch.mul(src, scale)
        assert torch.equal(out, want)
        # nothing outside the destination was written
        assert dst[:offsets[1]].isnan().all() and dst[offsets[1] + numel:].isnan().all()
    finally:
        torch.set_num_threads(old)


def test_declines_what_it_does_not_handle_and_touches_nothing():
    big = torch.randn(MIN * 2)
    cases = [
        (torch.empty(MIN - 1), torch.randn(MIN - 1)),               # small: ATen's
        (torch.empty(MIN * 2, dtype=torch.float64), big.double()),  # not float32
        (torch.empty(MIN * 2, dtype=torch.bfloat16), big),          # dtypes differ
        (torch.empty(MIN * 4)[::2], big),                           # strided
        (torch.empty(MIN * 2 + 1), big),                            # sizes differ
        (big, big),                                                 # overlapping
        (big[1:], big[:-1]),
    ]
    for dst, src in cases:
        before = dst.clone()
        assert not _C._stream_copy(dst, src, 0.5)
        assert torch.equal(dst, before) or (dst.isnan() == before.isnan()).all()


def _with_and_without(rank, world_size):
    import copy

    import torch.distributed as dist

    import pycomm
    from tests.support.ddp_models import build, loss_of, make_input

    base = build("wide")
    grads = {}
    for streaming in (True, False):
        ddp = pycomm.DistributedDataParallel(
            copy.deepcopy(base), config=pycomm.DDPConfig(streaming_copies=streaming))
        assert ddp.reducer is not None
        for step in range(2):  # step 2 runs on the re-cut buckets
            ddp.zero_grad()
            loss_of(ddp(make_input("wide", rank, step))).backward()
        grads[streaming] = [p.grad.clone() for p in ddp.parameters()]
    for a, b in zip(grads[True], grads[False]):
        assert torch.equal(a, b)
    dist.barrier()


def test_ddp_config_streaming_copies_off_gives_the_same_bits():
    from tests.support.multirank import run_ranks

    run_ranks(_with_and_without, 2)
