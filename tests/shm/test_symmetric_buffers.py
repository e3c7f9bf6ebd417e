"""Symmetric buffers (Note [Symmetric buffers]): tensors in shared memory every rank maps,
all-reduced in place without the copies through the segment; the DDP buckets that live
there; the collective fallback to private memory when a rank cannot get the memory; the
error when ranks pass different buffers."""

import copy
import os
import resource
import signal

import pytest
import torch
import torch.distributed as dist

import pycomm
import pycomm.shm
from tests.support.ddp_models import build, make_input, tanh_mlp, train_sgd
from tests.support.multirank import run_ranks


def _pycomm_group():
    group = pycomm.shm.same_host_group(dist.group.WORLD)
    assert group is not None and dist.get_backend(group) == "pycomm"
    return group, group._get_backend(torch.device("cpu"))


def _arena_files():
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith("pycomm-") and ".a" in f)


# Sizes around the paths: the one-phase path (<= 256 KiB), one chunk, several chunks with
# a ragged last one, and a part count that does not divide the chunk.
NUMELS = [1, 1000, 65536, 65537, 262144 + 17, 1 << 20, (3 << 20) + 5]


def _all_reduce_in_place(rank, world):
    group, backend = _pycomm_group()
    dtypes = [torch.float32] * len(NUMELS) + [torch.float64, torch.int64, torch.bfloat16]
    numels = NUMELS + [300_001, 300_001, 300_001]
    buffers, why = backend.symmetric_buffers(numels, dtypes)
    assert why == "" and len(buffers) == len(numels)
    assert all(b.dtype == d and b.numel() == n and not b.any()
               for b, d, n in zip(buffers, dtypes, numels))
    # Every rank removed its file's name once all had mapped it: nothing left in /dev/shm.
    dist.barrier(group=group)
    assert _arena_files() == []
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.AVG):
        for buf in buffers:
            if op == dist.ReduceOp.AVG and not buf.is_floating_point():
                continue
            values = [torch.randint(-50, 50, (buf.numel(),), generator=torch.Generator()
                                    .manual_seed(1000 * r + buf.numel())).to(buf.dtype)
                      for r in range(world)]
            buf.copy_(values[rank])
            dist.all_reduce(buf, op=op, group=group)
            stacked = torch.stack([v.double() for v in values])
            want = {dist.ReduceOp.SUM: stacked.sum(0), dist.ReduceOp.MAX: stacked.amax(0),
                    dist.ReduceOp.AVG: stacked.sum(0) / world}[op]
            # Small integers: sums and maxima exact in every dtype; averages rounded once.
            exact = op != dist.ReduceOp.AVG
            rtol = 0 if exact else (1e-2 if buf.dtype == torch.bfloat16 else 1e-6)
            torch.testing.assert_close(buf.double(), want, rtol=rtol, atol=0)
            # Every rank holds the same bits.
            gathered = [torch.empty_like(buf) for _ in range(world)]
            dist.all_gather(gathered, buf, group=group)
            assert all(torch.equal(g, buf) for g in gathered)
    # A view at an offset inside the arena goes the same way.
    big = buffers[-4]
    part = big[4097:4097 + 500_000]
    part.fill_(rank + 1)
    dist.all_reduce(part, group=group)
    assert torch.all(part == world * (world + 1) / 2)
    # The tensors keep the memory alive after the group is gone.
    dist.destroy_process_group(group)
    big.add_(1)
    assert float(big[5000]) == world * (world + 1) / 2 + 1


@pytest.mark.parametrize("world_size", [2, 3])
def test_symmetric_all_reduce_in_place(world_size):
    run_ranks(_all_reduce_in_place, world_size=world_size, backend="gloo")


def _different_buffers(rank, world):
    group, backend = _pycomm_group()
    buffers, why = backend.symmetric_buffers([1 << 20, 1 << 20], [torch.float32] * 2)
    assert why == ""
    with pytest.raises(RuntimeError) as raised:
        dist.all_reduce(buffers[rank % 2], group=group)  # rank 0 the first, rank 1 the second
    text = str(raised.value)
    assert "rank 0 passed" in text or "rank 1 passed" in text, text
    assert "at byte 0 of arena" in text and "at byte 4194304 of arena" in text, text


def test_ranks_passing_different_buffers_fail_by_name():
    run_ranks(_different_buffers, world_size=2, backend="gloo")


def _deny_files(limit_bytes):
    # A file-size limit: creating the arena file fails with EFBIG, as a full /dev/shm fails
    # with ENOSPC. SIGXFSZ ignored so that the call fails instead of the process dying.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, resource.RLIM_INFINITY))


def _fallback(rank, world):
    group, backend = _pycomm_group()
    if rank == 1:
        _deny_files(64 << 10)
    buffers, why = backend.symmetric_buffers([4 << 20], [torch.float32])
    # Every rank gives up, with the failing rank's reason, and leaves nothing behind.
    assert buffers == [] and why.startswith("rank 1: cannot size"), why
    assert "File too large" in why, why
    dist.barrier(group=group)
    assert _arena_files() == []
    # DDP then keeps private buckets on every rank, says why, and trains as torch's does.
    base = tanh_mlp()
    with pytest.warns(UserWarning, match="buckets stay in private memory"):
        ours = pycomm.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.1)
    assert not ours.reducer.buckets_shared and "rank 1" in ours.reducer.shared_buckets_why
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.1)
    for a, b in zip(train_sgd(ours, rank), train_sgd(ref, rank)):
        assert torch.equal(a, b)


def test_every_rank_falls_back_when_one_cannot_share():
    run_ranks(_fallback, world_size=2, backend="gloo")


def _ddp_buckets(rank, world, as_view):
    model = build("wide")
    cfg = dict(bucket_cap_mb=1, gradient_as_bucket_view=as_view)
    ours = pycomm.DistributedDataParallel(copy.deepcopy(model), **cfg)
    private = pycomm.DistributedDataParallel(
        copy.deepcopy(model), config=pycomm.DDPConfig(shared_memory_buckets=False, **cfg))
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), **cfg)
    assert ours.reducer.buckets_shared and not private.reducer.buckets_shared
    assert ours._get_ddp_logging_data()["buckets_in_shared_memory"] == 1
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, private, ref)]
    for step in range(4):  # the bucket rebuild after step 1 makes a new arena
        for m, opt in zip((ours, private, ref), opts):
            opt.zero_grad(set_to_none=not as_view)
            m(make_input("wide", rank, step)).float().pow(2).mean().backward()
            opt.step()
        assert ours.reducer.buckets_shared
        for p, q, r in zip(ours.parameters(), private.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad) and torch.equal(p.grad, r.grad)
            assert torch.equal(p, r)
    if as_view:
        # The grads are the shared buckets; they stay valid after the wrapper is gone.
        grads = [p.grad for p in ours.parameters()]
        del ours
        assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("as_view", [False, True])
def test_ddp_buckets_in_shared_memory_match_torch(as_view):
    run_ranks(_ddp_buckets, world_size=2, backend="gloo", as_view=as_view)
