"""The flat parameter buffers of pycomm.ZeroRedundancyOptimizer, a mixin of the optimizer
(FlatShards): each bucket's parameters become views of one buffer, this rank's pieces of
it (or fp32 main copies of them) are what the wrapped optimizer steps, and after the step
the buffers are all-gathered and the tails broadcast from their owner (See Note [Flat
shards of a bucket] in layout.py)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import adam_step
from . import layout as shard_layout
from .layout import BucketShard, Piece

# torch 2.13 renamed the tensor forms (the old names warn); torch 2.11 has only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_WIDENED = (torch.float16, torch.bfloat16)


class FlatShards:
    # ---- the layout: flat parameter buffers, pieces, the wrapped optimizer ------------

    def _relayout(self, whole: Optional[dict[int, dict]]) -> None:
        """Cut the current buckets; parameters become views of per-bucket flat buffers; the
        wrapped optimizer is built over this rank's pieces and given `whole` (per parameter
        index, whole states) cut to them."""
        buckets = self._buckets()
        self._signature = shard_layout.signature(buckets)
        self._shards: list[BucketShard] = shard_layout.cut(
            buckets, self._params, self.world_size, self.rank, self._step_block())
        self._flat: list[torch.Tensor] = []
        with torch.no_grad():
            for shard in self._shards:
                first = self._params[shard.params[0]]
                flat = torch.empty(shard.numel, dtype=first.dtype, device=first.device)
                for i, off, n in zip(shard.params, shard.offsets, shard.lengths):
                    p = self._params[i]
                    flat[off:off + n].copy_(p.detach().reshape(-1))
                    p.data = flat[off:off + n].view(p.shape)
                self._flat.append(flat)
        state = getattr(self, "_hook_state", None)
        if state is not None:  # shards the hook kept for buckets that are gone
            sizes = {s.index: s.kept for s in self._shards}
            for index in [i for i, t in state.grads.items() if sizes.get(i) != t.numel()]:
                state.keep.drop(index)
        self._pieces: list[tuple[BucketShard, Piece, torch.Tensor]] = []
        group_of = {id(p): g for g, group in enumerate(self.param_groups) for p in group["params"]}
        inner_groups = [dict(g, params=[]) for g in self.param_groups]
        for shard, flat in zip(self._shards, self._flat):
            for piece in shard.pieces:
                run = flat[piece.flat:piece.flat + piece.numel]
                main = run.float() if run.dtype in _WIDENED else run
                self._pieces.append((shard, piece, main))
                inner_groups[group_of[id(self._params[piece.param])]]["params"].append(main)
        # one inner group per group, empty where this rank steps none of its elements
        # (torch's ZeroRedundancyOptimizer keeps them too): hyperparameters pair by index
        self.optim = self._optimizer_class(inner_groups, **self.defaults)
        self._sync_groups(into_inner=False)
        if whole:
            self._load_whole(whole)
        if getattr(self, "_module_buckets", None) is not None:
            self._map_modules()

    def _step_block(self) -> int:
        """The pieces' longest run (0: unblocked): See Note [Stepping in cache-sized
        blocks] in layout.py; blocks for an optimizer that steps CPU tensors one at a
        time (neither foreach nor fused, in any group), unless the one-pass Adam steps
        them (pycomm/adam_step.py), which blocks its own passes."""
        lists = any(g.get(k) for g in [self.defaults, *self.param_groups]
                    for k in ("foreach", "fused"))
        on_cpu = all(p.device.type == "cpu" for p in self._params)
        if lists or not on_cpu:
            return 0
        if (self._optimizer_class not in adam_step.CLASSES
                or any(p.dtype not in (torch.float32, *_WIDENED) for p in self._params)):
            return shard_layout.STEP_BLOCK
        # the groups as the wrapped optimizer will hold them, its defaults filled in
        groups = self._optimizer_class(
            [dict({k: v for k, v in g.items() if k != "params"}, params=[torch.zeros(0)])
             for g in self.param_groups], **self.defaults).param_groups
        one_pass = adam_step.options_reason(self._optimizer_class, groups) is None
        return 0 if one_pass else shard_layout.STEP_BLOCK

    def _sync_groups(self, into_inner: bool = True) -> None:
        """Hyperparameters (lr from a scheduler...) between the full groups and the wrapped
        optimizer's: self.param_groups is the one users and schedulers change."""
        for inner, outer in zip(self.optim.param_groups, self.param_groups):
            for key, value in (outer if into_inner else inner).items():
                if key != "params":
                    (inner if into_inner else outer)[key] = value

    def _broadcast_tails(self) -> None:
        """Every bucket's tail from its owner (See Note [Flat shards of a bucket] in
        layout.py), packed: one broadcast per dtype and device."""
        if self.world_size == 1:
            return
        tails: dict[tuple, list[torch.Tensor]] = {}
        for shard, flat in zip(self._shards, self._flat):
            lo, hi = shard.tail
            if hi > lo:
                tails.setdefault((flat.dtype, flat.device), []).append(flat[lo:hi])
        if not tails:
            return
        owner = dist.get_global_rank(self._comm_group, self._shards[0].tail_owner)
        for runs in tails.values():
            packed = torch.cat(runs) if len(runs) > 1 else runs[0].clone()
            dist.broadcast(packed, src=owner, group=self._comm_group)
            if self.rank != self._shards[0].tail_owner:
                torch._foreach_copy_(runs, list(packed.split([r.numel() for r in runs])))

    def _gather(self) -> None:
        """All-gather every bucket's parameters, last bucket first."""
        world = self.world_size
        self.gathers.begin_step()
        for shard in reversed(self._shards):
            ranges = shard.ranges
            if world == 1 or ranges.shard == 0:
                continue
            flat = self._flat[shard.index]
            work = _all_gather(flat[ranges.ranges], flat[ranges.mine],
                               group=self._comm_group, async_op=True)
            self._pending[shard.index] = work
            self.gathers.launched(shard.index, work)
        if not (self.overlap_with_ddp and self._ddp is not None):
            self.wait_for_params()
