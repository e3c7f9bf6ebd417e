"""pycomm's DDP under torch.compile, 2 Gloo ranks, against torch's DDP under torch.compile:
the graph split at pycomm's buckets (buckets launch during backward), gradients, no_sync,
static_graph, find_unused_parameters, activation checkpointing, recompilation, and the
refusal of compiled autograd. backend="aot_eager" throughout: the same graphs and splits
as inductor, without its code generation.

Tolerance: exact. Under aot_eager both DDPs run the same aten ops on the same pieces
(dynamo splits both graphs at the same cap, see _CAP_MB), and the reduction of two ranks
is a + b whatever the transport, so any difference is a bug, not noise. Where torch's DDP
cannot compile (a split refused) the reference is torch's DDP in eager mode: aot_eager
runs the aten ops eager mode runs, unfused, in the same order, so exact there too."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.checkpoint import checkpoint

import pycomm
from tests.support.multirank import run_ranks

_CAP_MB = 1.0  # >= dynamo's 1 MiB first piece, so torch's DDP compiles with it too
_WIDTH = 512   # a Linear(512, 512) holds 1 MiB of gradient: one bucket, one piece


class _Stack(nn.Module):
    """`depth` Linear+ReLU layers, the middle one under activation checkpointing when
    `checkpointed` (a higher-order op in dynamo's graph); with `spare`, a layer that takes
    no part."""

    def __init__(self, depth: int = 4, width: int = _WIDTH, checkpointed: bool = False,
                 spare: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.spare = nn.Linear(width, 4) if spare else None
        self.checkpointed = checkpointed

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if self.checkpointed and i == len(self.layers) // 2:
                x = checkpoint(lambda t, f=layer: torch.relu(f(t)), x, use_reentrant=False)
            else:
                x = torch.relu(layer(x))
        return x


def _counter():
    from torch._dynamo.testing import CompileCounterWithBackend

    return CompileCounterWithBackend("aot_eager")


def _data(rank: int, step: int, batch: int = 8, width: int = _WIDTH) -> torch.Tensor:
    return torch.randn(batch, width, generator=torch.Generator().manual_seed(100 * step + rank))


def _compiled(make, base: nn.Module, compile_module: bool = False, **kwargs):
    """(DDP module, what a step calls, compile counter): `make(copy of base)` compiled as
    torch.compile(ddp), or as ddp.module = torch.compile(ddp.module) with compile_module."""
    ddp = make(copy.deepcopy(base), bucket_cap_mb=_CAP_MB, **kwargs)
    count = _counter()
    if compile_module:
        ddp.module = torch.compile(ddp.module, backend=count)
        return ddp, ddp, count
    return ddp, torch.compile(ddp, backend=count), count


def _assert_same_grads(a: nn.Module, b: nn.Module, what: str) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        if p.grad is None or q.grad is None:
            assert p.grad is None and q.grad is None, f"{what}: grad of {name}"
        else:  # exact: see the module docstring
            assert torch.equal(p.grad, q.grad), \
                f"{what}: grad of {name} differs by {(p.grad - q.grad).abs().max().item()}"


def _train_both(rank, pairs, steps, micro=0, what=""):
    """`steps` SGD steps of each (ddp, run) pair on the same data, `micro` no_sync
    micro-batches before each synchronized one; gradients compared after every step."""
    opts = [torch.optim.SGD(ddp.parameters(), lr=0.1) for ddp, _ in pairs]
    for step in range(steps):
        for (ddp, run), opt in zip(pairs, opts):
            opt.zero_grad()
            for m in range(micro):
                with ddp.no_sync():
                    run(_data(rank, 10 * step + m + 1)).square().mean().backward()
            run(_data(rank, 10 * step)).square().mean().backward()
        _assert_same_grads(pairs[0][0].module, pairs[1][0].module, f"{what} step {step}")
        for opt in opts:
            opt.step()


# ---- the split: buckets launch during the compiled backward ------------------------------

def _first_launch_fraction(ddp) -> float:
    """When the first bucket launched, as a fraction of the backward compute (backward start
    to the last gradient ready) of the last step: near 1 when every gradient lands at the
    end of one compiled backward, about 1/pieces when the graph is split."""
    r = ddp.last_step_report()
    return min(b.launch_s for b in r.buckets) / r.compute_s


def _split_overlaps(rank, world_size):
    torch.manual_seed(0)
    # Heavier layers than _Stack's default batch: each piece's backward takes long enough
    # that "launched at the end" and "launched after the first piece" are far apart.
    stack = _Stack(depth=4, width=1024)
    # nn.Sequential's forward is torch's own code, which dynamo does not compile as the
    # first frame of a call: pycomm calls it from a frame of its own (pycomm/ddp/compile.py).
    sequential = nn.Sequential(*(m for layer in stack.layers for m in (layer, nn.ReLU())))
    x = [_data(rank, s, batch=256, width=1024) for s in range(3)]
    for base, compile_module in ((stack, False), (stack, True), (sequential, False)):
        what = (type(base).__name__, compile_module)
        torch._dynamo.reset()
        ours, run, count = _compiled(pycomm.DistributedDataParallel, base, compile_module)
        for step in range(3):
            run(x[step]).square().mean().backward()
        # 4 layers of 4 MiB each: 4 pieces (dynamo's count of backend calls) and, after the
        # rebuild, 4 buckets of one layer each, the bias with its weight.
        assert count.frame_count == 4, (what, count.frame_count)
        buckets = ours.reducer.bucket_indices()
        assert len(buckets) == 4 and all(len(b) == 2 for b in buckets), (what, buckets)
        fraction = _first_launch_fraction(ours)
        assert fraction < 0.6, (what, fraction, ours.last_step_report())


def test_compiled_ddp_splits_at_buckets_and_launches_them_during_backward():
    run_ranks(_split_overlaps)


def test_bucket_cut_keeps_a_gradient_group_whole_unless_each_part_fills_a_bucket():
    # Five 100-byte gradients in ready order, 150-byte buckets. See Note [Gradient groups].
    params = [torch.zeros(25) for _ in range(5)]
    order, limits = list(range(5)), [150]
    cut = pycomm._C.assign_buckets
    assert cut(params, order, limits) == [[0, 1], [2, 3], [4]]
    assert cut(params, order, limits, [0, 1, 2, 3, 4]) == [[0, 1], [2, 3], [4]]
    # Two bursts (0-2, 3-4): buckets end where the bursts end.
    assert cut(params, order, limits, [7, 7, 7, 9, 9]) == [[0, 1, 2], [3, 4]]
    # One burst of all five: cut where the rest still fills a bucket, not after 3.
    assert cut(params, order, limits, [7] * 5) == [[0, 1], [2, 3, 4]]


# ---- gradients against torch's DDP + torch.compile ---------------------------------------

_FEATURES = {"plain": {}, "compile_module": {}, "no_sync": {},
             "static_graph": {"static_graph": True},
             "find_unused_parameters": {"find_unused_parameters": True}}


def _parity(rank, world_size):
    for case, kwargs in _FEATURES.items():  # one process for all: dynamo's import is slow
        torch.manual_seed(0)
        base = _Stack(depth=3, spare=case == "find_unused_parameters")
        torch._dynamo.reset()
        theirs = _compiled(TorchDDP, base, **kwargs)
        ours = _compiled(pycomm.DistributedDataParallel, base, case == "compile_module",
                         **kwargs)
        _train_both(rank, [theirs[:2], ours[:2]], steps=3,
                    micro=2 if case == "no_sync" else 0, what=case)
        # Three 1 MiB layers, three pieces, compiled once: neither no_sync, nor the bucket
        # rebuild after step 1, nor static_graph's first step recompiled anything.
        assert ours[2].frame_count == 3, (case, ours[2].frame_count, theirs[2].frame_count)


def test_compiled_gradients_equal_torch_ddp_compiled_with_each_feature():
    run_ranks(_parity)


# ---- activation checkpointing: a higher-order op in the graph ----------------------------

_REFUSAL = ("DDPOptimizer backend: Found a higher order op in the graph. This is not "
            "supported.")  # torch < 2.6's words


def _refusing_split(monkeypatch_target):
    """dynamo's DDPOptimizer as torch < 2.6 has it: it fails any graph holding a
    higher-order op (torch issue 104674)."""
    from torch._dynamo.backends import distributed

    split = distributed.DDPOptimizer.compile_fn

    def refusing(self, gm, example_inputs, **kwargs):
        if distributed.has_higher_order_op(gm):
            raise NotImplementedError(_REFUSAL)
        return split(self, gm, example_inputs, **kwargs)

    monkeypatch_target.setattr(distributed.DDPOptimizer, "compile_fn", refusing)


def _checkpointed(rank, world_size):
    torch.manual_seed(0)
    base = _Stack(depth=3, checkpointed=True)
    torch._dynamo.reset()
    theirs = _compiled(TorchDDP, base)
    ours = _compiled(pycomm.DistributedDataParallel, base)
    _train_both(rank, [theirs[:2], ours[:2]], steps=2, what="checkpointed")
    assert ours[2].frame_count == 3, ours[2].frame_count  # split kept, checkpoint and all

    # A torch whose dynamo refuses to split it: torch's DDP fails to compile; pycomm's warns
    # and compiles the module whole, with the gradients of torch's DDP in eager mode.
    from torch._dynamo.exc import BackendCompilerFailed

    with pytest.MonkeyPatch.context() as mp:
        _refusing_split(mp)
        torch._dynamo.reset()
        refused = _compiled(TorchDDP, base)
        with pytest.raises(BackendCompilerFailed, match="Found a higher order op"):
            refused[1](_data(rank, 0))
        torch._dynamo.reset()
        eager = TorchDDP(copy.deepcopy(base), bucket_cap_mb=_CAP_MB)
        ours = _compiled(pycomm.DistributedDataParallel, base)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _train_both(rank, [(eager, eager), ours[:2]], steps=2, what="refused split")
    said = [str(w.message) for w in caught if "higher-order op" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert ours[0]._graph_split.refused and ours[2].frame_count == 1, ours[2].frame_count


def test_checkpointed_module_keeps_the_split_or_falls_back_with_a_warning():
    run_ranks(_checkpointed)


# ---- recompilation -----------------------------------------------------------------------

class _Tokens(nn.Module):
    """Three 1 MiB layers over (batch, sequence, width) inputs: a new sequence length is a
    new shape for dynamo."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(_WIDTH, _WIDTH) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.mean(1)


def _recompiles(rank, world_size):
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    base = _Tokens()
    compiled, looked_at = {}, {}
    for make in (TorchDDP, pycomm.DistributedDataParallel):
        torch._dynamo.reset()
        ddp, run, count = _compiled(make, base)
        for step, length in enumerate((8, 12, 16, 20, 24)):
            g = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(2, length, _WIDTH, generator=g)
            if step == 3:  # a micro-batch in no_sync: not a recompilation either
                with ddp.no_sync():
                    run(x).square().mean().backward()
            run(x).square().mean().backward()
            if step == 1:
                frames = counters["frames"]["total"]
        compiled[make.__module__] = count.frame_count
        # Frames dynamo was handed after the dynamic recompilation: none, for either.
        looked_at[make.__module__] = counters["frames"]["total"] - frames
    # dynamo compiles the first length static and the second one with a dynamic length,
    # then reuses it: 2 compilations of 3 pieces, for torch's DDP and for pycomm's.
    ours = pycomm.DistributedDataParallel.__module__
    assert compiled == {TorchDDP.__module__: 6, ours: 6}, compiled
    assert looked_at == {TorchDDP.__module__: 0, ours: 0}, looked_at


def test_new_sequence_lengths_recompile_as_for_torch_ddp():
    run_ranks(_recompiles)


# ---- compiled autograd -------------------------------------------------------------------

def _compiled_autograd(rank, world_size):
    for mode in ("ddp_optimizer", "python_reducer"):
        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch._dynamo.config.optimize_ddp = mode
            ddp = pycomm.DistributedDataParallel(_Stack(depth=2, width=16))
        named = [str(w.message) for w in caught if "python_reducer" in str(w.message)]
        assert len(named) == (mode == "python_reducer"), named
        torch._dynamo.config.compiled_autograd = True  # read when a function is compiled
        with pytest.raises(RuntimeError, match="compiled_autograd=True") as raised:
            _train_step(ddp)(_data(rank, 0, width=16))
        assert "pycomm DDP cannot reduce gradients under compiled autograd" in \
            str(raised.value), mode
        # Refused before backward computed anything: no gradient was left unreduced.
        assert all(p.grad is None for p in ddp.parameters()), mode
        torch._dynamo.config.compiled_autograd = False
        # Without compiled autograd the same step reduces, in this mode too: with each
        # rank's own data, gradients agree across ranks only once reduced.
        _train_step(ddp)(_data(rank, 0, width=16))
        for p in ddp.parameters():
            other = p.grad.clone()
            dist.broadcast(other, 0)
            assert torch.equal(other, p.grad), mode


def _train_step(ddp):
    @torch.compile(backend="aot_eager")
    def train_step(x):
        loss = ddp(x).square().mean()
        loss.backward()
        return loss

    return train_step


def test_compiled_autograd_raises_naming_the_setting():
    run_ranks(_compiled_autograd)
