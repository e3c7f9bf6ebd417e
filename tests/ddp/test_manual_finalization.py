"""torch 2.15's manual backward finalization (require_manual_backward_finalization,
should_finalize_after_backward, finalize_backward()) on pycomm's DDP, against torch's DDP
run the same way: the same parameters and optimizer state, bit for bit, as torch's and as
pycomm's automatic finalization; torch's errors, each leaving the step intact; the
overlap report of a step whose optimizer work ran before finalize. On a torch without the
API, pycomm's DDP lacks it as torch's does."""

from __future__ import annotations

import copy
import pickle
import time

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pycomm
from pycomm.ddp.finalization import TORCH_HAS_MANUAL_FINALIZATION
from tests.support.multirank import run_ranks

DDP = pycomm.DistributedDataParallel
NAMES = ("require_manual_backward_finalization", "should_finalize_after_backward",
         "finalize_backward")
needs_api = pytest.mark.skipif(not TORCH_HAS_MANUAL_FINALIZATION,
                               reason=f"torch {torch.__version__}'s DDP has no manual backward "
                                      f"finalization (torch >= 2.15)")


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * rank + step))


def _train(ddp, rank: int, steps: int, how: str, micro: bool = True) -> torch.optim.Optimizer:
    """`steps` AdamW steps, with `micro` one no_sync micro-batch before each synchronized one;
    `how` the step ends: "auto" (backward finalizes), "after" (finalize_backward() after backward
    returns), "hook" (from a callback queued by the first layer's gradient hook, the last
    gradient of the backward, while backward still runs)."""
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    if how != "auto":
        ddp.require_manual_backward_finalization = True
    first = ddp.module[0].weight
    engine = torch.autograd.Variable._execution_engine
    for step in range(steps):
        opt.zero_grad()
        if micro:
            with ddp.no_sync():
                ddp(_batch(rank, 100 + step)).square().mean().backward()
        loss = ddp(_batch(rank, step)).square().mean()
        handle = None
        if how == "hook" and not ddp.should_finalize_after_backward:
            handle = first.register_post_accumulate_grad_hook(
                lambda p: engine.queue_callback(ddp.finalize_backward))
        loss.backward()
        if handle is not None:
            handle.remove()
        elif how != "auto":
            ddp.finalize_backward()
        opt.step()
    return opt


def _assert_bitwise(a, b, opt_a, opt_b, what: str) -> None:
    for (name, x), y in zip(a.module.named_parameters(), b.module.parameters()):
        assert torch.equal(x, y), f"{what}: parameter {name} differs"
    states = zip(opt_a.state_dict()["state"].items(), opt_b.state_dict()["state"].values())
    for (i, sa), sb in states:
        for key in sa:
            assert torch.equal(torch.as_tensor(sa[key]), torch.as_tensor(sb[key])), \
                f"{what}: optimizer state {key} of parameter {i} differs"


def _same_as_torch(rank, world_size, static_graph):
    kwargs = dict(bucket_cap_mb=0.002, static_graph=static_graph)
    # torch's static_graph fails a backward after a no_sync one ("Expected to have finished
    # reduction"), with or without manual finalization: no micro-batches there
    micro = not static_graph
    ref = TorchDDP(_model(), **kwargs)
    ref_opt = _train(ref, rank, 4, "after", micro)
    for how in ("after", "hook", "auto"):
        ours = DDP(_model(), **kwargs)
        assert len(ours.reducer.bucket_indices()) > 1  # several buckets in flight at once
        opt = _train(ours, rank, 4, how, micro)
        _assert_bitwise(ref, ours, ref_opt, opt, f"static_graph={static_graph} {how}")


@needs_api
@pytest.mark.parametrize("static_graph", [False, True])
def test_manual_finalization_matches_torch_and_the_automatic_path(static_graph):
    run_ranks(_same_as_torch, world_size=2, static_graph=static_graph)


def _raises_alike(ref, ours, fn, match: str) -> None:
    """torch's DDP and pycomm's both raise RuntimeError on fn(ddp); pycomm's says `match`."""
    with pytest.raises(RuntimeError):
        fn(ref)
    with pytest.raises(RuntimeError, match=match):
        fn(ours)


def _errors(rank, world_size):
    ref, ours = TorchDDP(_model(), bucket_cap_mb=0.002), DDP(_model(), bucket_cap_mb=0.002)
    both = (ref, ours)
    _raises_alike(ref, ours, lambda d: d.finalize_backward(), "set require_manual_backward")
    for ddp in both:
        assert not ddp.require_manual_backward_finalization
        assert not ddp.should_finalize_after_backward
        ddp.require_manual_backward_finalization = True
    _raises_alike(ref, ours, lambda d: d.finalize_backward(), "no synchronized backward awaits")
    losses = [ddp(_batch(rank, 0)).sum() for ddp in both]
    # Switching the mode between a synchronized forward and its finalize.
    _raises_alike(ref, ours, lambda d: setattr(d, "require_manual_backward_finalization",
                                               False), "only change before a forward")
    # From a hook before the backward's last gradient is in: raises in the hook, and the
    # backward and the step go on.
    caught = {}
    for i, (ddp, loss) in enumerate(zip(both, losses)):
        def early(p, ddp=ddp, i=i):
            try:
                ddp.finalize_backward()
            except RuntimeError as e:
                caught[i] = str(e)
        handle = ddp.module[4].weight.register_post_accumulate_grad_hook(early)
        loss.backward()
        handle.remove()
    assert set(caught) == {0, 1} and "before every gradient" in caught[1], caught
    # The next forward before finalize: refused, the step kept for finalize_backward().
    _raises_alike(ref, ours, lambda d: d(_batch(rank, 1)), "was not finalized")
    _raises_alike(ref, ours, lambda d: d.no_sync().__enter__() or d(_batch(rank, 1)),
                  "was not finalized")
    for ddp in both:
        ddp.require_backward_grad_sync = True  # the no_sync() entered above
        with torch.no_grad():  # an evaluation forward may run before the finalize
            ddp(_batch(rank, 4))
        ddp.finalize_backward()
    for (name, x), y in zip(ref.module.named_parameters(), ours.module.parameters()):
        assert torch.equal(x.grad, y.grad), f"gradient of {name} after the refused forward"
    _raises_alike(ref, ours, lambda d: d.finalize_backward(), "already ended it")
    for ddp in both:
        with ddp.no_sync():
            ddp(_batch(rank, 2)).sum().backward()
    _raises_alike(ref, ours, lambda d: d.finalize_backward(), "no_sync")
    for ddp in both:  # off again between steps: backward finalizes itself
        ddp.require_manual_backward_finalization = False
        ddp(_batch(rank, 3)).sum().backward()
    for (name, x), y in zip(ref.module.named_parameters(), ours.module.parameters()):
        assert torch.equal(x.grad, y.grad), f"gradient of {name} once the mode is off"


@needs_api
def test_errors_as_torch_raises_them_and_the_step_survives():
    run_ranks(_errors, world_size=2)


def _should(rank, world_size):
    for kwargs in (dict(), dict(static_graph=True), dict(find_unused_parameters=True)):
        ours = DDP(_model(), bucket_cap_mb=0.002, **kwargs)
        seen = []
        for manual in (False, True):
            ours.require_manual_backward_finalization = manual
            for step in range(2):
                loss = ours(_batch(rank, step)).sum()
                seen.append(ours.should_finalize_after_backward)
                loss.backward()
                if manual:
                    ours.finalize_backward()
        # Only static_graph's first step (its usage is counted at the end of backward); the
        # first manual step is static_graph's third, so it is False there too.
        assert seen == [False] * 4, (kwargs, seen)
        fresh = DDP(_model(), bucket_cap_mb=0.002, **kwargs)
        fresh.require_manual_backward_finalization = True
        fresh(_batch(rank, 0)).sum()
        assert fresh.should_finalize_after_backward == bool(kwargs.get("static_graph")), kwargs


@needs_api
def test_should_finalize_after_backward_only_while_usage_is_counted():
    run_ranks(_should, world_size=2)


def _survives_rebuilds(rank, world_size):
    ours = DDP(_model(), bucket_cap_mb=0.002)
    ours.require_manual_backward_finalization = True
    ours._set_static_graph()  # rebuilds the reducer
    assert ours.require_manual_backward_finalization
    loaded = pickle.loads(pickle.dumps(ours))
    assert loaded.require_manual_backward_finalization
    ref = TorchDDP(_model(), bucket_cap_mb=0.002, static_graph=True)
    ref.require_manual_backward_finalization = True
    ref_opt, opt = _train(ref, rank, 3, "after", False), _train(loaded, rank, 3, "after", False)
    _assert_bitwise(ref, loaded, ref_opt, opt, "unpickled")


@needs_api
def test_manual_mode_survives_static_graph_rebuild_and_pickling():
    run_ranks(_survives_rebuilds, world_size=2)


def _overlap(rank, world_size):
    model = _model()
    side = torch.nn.Linear(256, 256)  # parameters the DDP does not reduce
    DDP._set_params_and_buffers_to_ignore_for_model(model, [])
    ddp = DDP(model, bucket_cap_mb=0.002)
    ddp.require_manual_backward_finalization = True
    side_opt = torch.optim.AdamW(side.parameters())
    side(torch.randn(64, 256)).sum().backward()
    for step in range(3):
        ddp(_batch(rank, step)).square().mean().backward()
        before = time.monotonic_ns()
        side_opt.step()  # runs while the last buckets' collectives may still be in flight
        after = time.monotonic_ns()
        ddp.finalize_backward()
        report = ddp.last_step_report()
        raw = report.timeline
        assert raw["manual_finalization"]
        last_launch = max(b["launch_ns"] for b in raw["buckets"])
        # Orders the code controls: every bucket launched before the caller's work began,
        # and finalize started once that work had ended.
        assert last_launch <= before <= after <= raw["finalize_start_ns"]
        assert report.caller_s >= (after - before) * 1e-9
        assert 0 <= report.comm_behind_caller_s <= report.exposed_comm_s + 1e-12
        assert "finalize_backward() called" in str(report)
    copy.deepcopy(side)


@needs_api
def test_overlap_report_shows_work_before_finalize():
    run_ranks(_overlap, world_size=2)


def test_the_api_is_torch_releases():
    """On any torch: pycomm's DDP has these names exactly where torch's has them."""
    for name in NAMES:
        assert hasattr(DDP, name) == hasattr(TorchDDP, name), name
