"""pycomm.clip_grad_norm_ on DTensor gradients: FSDP2 (`fully_shard`), `replicate`, HSDP and
tensor-parallel meshes, and parameters spread over several meshes or pipeline stages.

Note [Clipping sharded gradients]
A DTensor gradient's local tensor is what this rank holds of it. Along a mesh dimension on
which it is Shard-ed, the ranks hold disjoint pieces, so the pieces' partials (sum |g|^p,
or max |g|; See Note [Clipping from partials] in pycomm/clip.py) add up across that
dimension; along one on which it is Replicate-d they hold copies, which count once. So the
total norm needs one fused pass over this rank's local tensors and, per mesh, one
all-reduce per mesh dimension some gradient is sharded on: none for `replicate`, one for
FSDP2 on a 1-D mesh, one for HSDP (the shard dimension only). torch's clip instead
dispatches DTensor ops per gradient: its first call in a process propagates shardings for
every gradient (seconds at 2,000 parameters, growing faster than linearly), later calls
still cost tens of microseconds per gradient (benchmarks/results/fsdp2_clip_cpu.md).

The plan (what each gradient contributes where) is decided per DTensorSpec, by the spec
object's identity: FSDP2 and replicate hand each parameter's gradient the same spec every
step, so only the first step looks at placements. Per step:
1. the local tensors are grouped by slot: (mesh, the dimensions they are sharded on);
2. each slot's norm partial in one fused pass, float64, as a row [acc, flag];
   1-2 run in one C++ call (pycomm._C._sharded_grads: the .grad, spec and local tensor
   reads, the slot lookup, the span lists, the passes) when every local tensor is a plain
   CPU one; else in Python, with ops.norm_partial per slot (CUDA local tensors, Partial
   placements, plain tensors across pipeline stages);
3. per mesh, for each of its dimensions in order, one all-reduce of the rows of the slots
   sharded on it (SUM, or MAX for the inf norm); a slot sharded on two dimensions is
   summed over both, one after the other;
4. the rows merge (+, or max), across meshes too, then across `pp_mesh` (the pipeline
   stages, whose ranks hold different parameters); the one finish of every clip
   (pycomm._C._finish_clip; See Note [One clip finish] in csrc/grad/clip.h) gives the norm
   in torch's dtype and rounding, and one scale pass per device scales every local tensor
   (none when the coefficient is 1).
For the inf norm, a NaN does not survive a MAX all-reduce (max(1, nan) depends on the
operands' order), so each row carries [max |g| with nan read as inf, whether it saw a
nan], and a nan flag after the merge makes the total nan, as torch's max propagates it.

A gradient with a Partial placement (pending sums, from some tensor-parallel plans) has
no local norm: its norm is taken of a copy redistributed to Replicate on those
dimensions (a collective per such gradient); the scale applies to the local summands, as
scaling is linear.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from .. import _C, ops

# Specs remembered at most; past it the memo starts over (only a model whose gradients get
# a fresh spec every step, e.g. some tensor-parallel plans, ever fills it).
_MEMO_LIMIT = 1 << 16


@dataclass(frozen=True, eq=False)
class _Slot:
    """Where one spec's gradients go: the mesh and the dimensions their partial is summed
    over, and the dimensions on which they are Partial (norm taken of a redistributed
    copy). Interned by _Memo: equal slots are one object, so it is hashed by identity."""
    mesh: DeviceMesh
    dims: tuple[int, ...]
    partial_dims: tuple[int, ...]


class _Memo:
    """Spec -> _Slot, keyed by the spec object's identity (the spec is kept alive with its
    slot, so an id is never reused while remembered). `index` is what the C++ walk reads:
    {id(spec): slot number}, negative for a slot only the Python walk takes (Partial)."""

    def __init__(self) -> None:
        self.specs: dict[int, Any] = {}
        self.index: dict[int, int] = {}
        self.slots: list[_Slot] = []
        self.interned: dict[tuple[DeviceMesh, tuple[int, ...], tuple[int, ...]], int] = {}
        self.built = 0  # specs looked at: stays at the number of distinct specs when cached

    def slot(self, spec: Any) -> _Slot:
        n = self.index.get(id(spec))
        if n is None or self.specs[id(spec)] is not spec:
            n = self.learn(spec)
        return self.slots[abs(n) - 1 if n < 0 else n]

    def learn(self, spec: Any) -> int:
        if len(self.specs) >= _MEMO_LIMIT:
            self.__init__()
        placements = spec.placements
        key = (spec.mesh, tuple(d for d, p in enumerate(placements) if p.is_shard()),
               tuple(d for d, p in enumerate(placements) if p.is_partial()))
        n = self.interned.get(key)
        if n is None:
            self.interned[key] = n = len(self.slots)
            self.slots.append(_Slot(*key))
        self.specs[id(spec)] = spec
        self.index[id(spec)] = -(n + 1) if key[2] else n
        self.built += 1
        return self.index[id(spec)]


_memo = _Memo()
# The slot of plain-tensor gradients (pipeline stages clipped through pp_mesh): no mesh,
# nothing summed but across the stages.
_PLAIN = _Slot(None, (), ())  # type: ignore[arg-type]


def plan_stats() -> dict[str, int]:
    """How many DTensor specs the clip has decided a slot for, and how many it remembers."""
    return {"built": _memo.built, "cached": len(_memo.specs)}


def _local_for_norm(g: DTensor, slot: _Slot) -> torch.Tensor:
    """What this rank's share of g's norm is taken of: its local tensor, or for Partial
    placements a copy with those dimensions reduced (See Note [Clipping sharded
    gradients])."""
    if not slot.partial_dims:
        return g._local_tensor
    placements = [Replicate() if p.is_partial() else p for p in g.placements]
    return g.redistribute(g.device_mesh, placements)._local_tensor


def _rows(partials: torch.Tensor, inf: bool) -> torch.Tensor:
    """Norm partials [k, 2] ([acc, nonfinite] each) as the float64 rows the all-reduces
    carry: for the inf norm [acc with nan read as inf, whether acc was nan]."""
    rows = partials.to(torch.float64)
    if inf:
        nan = torch.isnan(rows[:, :1])
        rows = torch.cat([rows[:, :1].masked_fill(nan, math.inf), nan.to(torch.float64)], 1)
    return rows


def _merge(rows: torch.Tensor, inf: bool) -> torch.Tensor:
    """Rows [k, 2] merged into one."""
    return rows.amax(0) if inf else rows.sum(0)


def _as_group(pp_mesh: Union[DeviceMesh, dist.ProcessGroup]) -> dist.ProcessGroup:
    if isinstance(pp_mesh, DeviceMesh):
        if pp_mesh.ndim != 1:
            raise ValueError(f"pycomm.clip_grad_norm_: pp_mesh must be a 1-D DeviceMesh (the "
                             f"pipeline stages), got {pp_mesh.ndim} dimensions")
        return pp_mesh.get_group()
    if isinstance(pp_mesh, dist.ProcessGroup):
        return pp_mesh
    raise TypeError(f"pycomm.clip_grad_norm_: pp_mesh must be a DeviceMesh or a ProcessGroup, "
                    f"got {type(pp_mesh).__name__}")


def clip_dtensor_grads_(params: list[torch.Tensor], max_norm: float, norm_type: float,
                        error_if_nonfinite: bool,
                        pp_mesh: Optional[Union[DeviceMesh, dist.ProcessGroup]] = None
                        ) -> torch.Tensor:
    """Clip the gradients of `params` in place (See Note [Clipping sharded gradients]); the
    total norm, a DTensor replicated on the gradients' mesh when there is one mesh and no
    `pp_mesh` (as torch's clip returns it), else a plain tensor. The gradients are all
    DTensors, or (with `pp_mesh`) all plain tensors, each rank's whole copy; without
    `pp_mesh`, gradients of another tensor subclass go to the pycomm::clip_grad_norm_ op."""
    norm_type = float(norm_type)
    if not norm_type > 0:
        # the C++ path's error (csrc/grad/grad_math.h norm_kind), for either path
        raise RuntimeError(f"pycomm.clip_grad_norm_: norm_type must be > 0 or inf, got "
                           f"{norm_type} (pycomm implements the p-norms torch users clip "
                           f"with: p > 0 and inf)")
    inf = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    # 1-2. each slot's norm partial (the plan's slots: a mesh and its sharded dimensions)
    walked = _walk_in_cpp(params, norm_type)
    if walked is None:
        grads = [g for g in (p.grad for p in params) if g is not None]
        if pp_mesh is None and not any(isinstance(g, DTensor) for g in grads):
            return ops.clip_grad_norm_(grads, max_norm, norm_type, error_if_nonfinite)
        walked = _walk_in_python(params, grads, norm_type, pp_mesh)
    partials, norm_dtype, scale = walked
    device = next(iter(partials.values())).device
    meshes: dict[DeviceMesh, list[_Slot]] = {}
    for slot in partials:
        meshes.setdefault(slot.mesh, []).append(slot)
    merged = []
    for mesh, slots in meshes.items():
        rows = _rows(torch.stack([partials[s].to(device) for s in slots]), inf)
        for dim in range(0 if mesh is None else mesh.ndim):
            on = [i for i, s in enumerate(slots) if dim in s.dims]
            if not on:
                continue
            group = mesh.get_group(dim)
            if len(on) == len(slots):
                dist.all_reduce(rows, op=op, group=group)
            else:
                part = rows[on]
                dist.all_reduce(part, op=op, group=group)
                rows[on] = part
        merged.append(_merge(rows, inf))
    # 4. merge, finish, scale
    total_row = _merge(torch.stack(merged), inf) if len(merged) > 1 else merged[0]
    if pp_mesh is not None:
        dist.all_reduce(total_row, op=op, group=_as_group(pp_mesh))
    partial = total_row
    if inf:
        partial = torch.stack([total_row[0].masked_fill(total_row[1] > 0, math.nan),
                               total_row[1]])
    total, coef = _C._finish_clip(partial, float(max_norm), norm_type, bool(error_if_nonfinite),
                                  norm_dtype)
    scale(coef)
    if len(meshes) == 1 and pp_mesh is None and _PLAIN not in partials:
        (mesh,) = meshes
        return DTensor.from_local(total, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return total


def _walk_in_cpp(params: list[torch.Tensor], norm_type: float):
    """Step 1-2 by pycomm._C._sharded_grads (csrc/grad/sharded_clip_bind.cpp): every gradient
    a DTensor with a plain CPU local tensor and no Partial placement. None: the Python walk."""
    walked = _C._sharded_grads(params, _memo.index, len(_memo.slots))
    while isinstance(walked, list):  # specs not seen before: decide their slots, walk again
        for spec in walked:
            _memo.slot(spec)
        walked = _C._sharded_grads(params, _memo.index, len(_memo.slots))
    if walked is None or walked.empty():
        return None
    rows = walked.partials(norm_type)
    partials = {_memo.slots[n]: rows[n] for n in walked.present()}
    return partials, walked.norm_dtype, walked.scale


def _walk_in_python(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                    norm_type: float, pp_mesh):
    """Step 1-2 for any gradients (CUDA local tensors, Partial placements, plain tensors
    across pipeline stages): the local tensors grouped by slot, ops.norm_partial per slot."""
    groups: dict[_Slot, list[torch.Tensor]] = {}
    scaled: list[torch.Tensor] = []
    norm_dtype: Optional[torch.dtype] = None
    slot_of = _memo.slot
    for g in grads:
        if isinstance(g, DTensor):
            slot = slot_of(g._spec)
            local = g._local_tensor
        else:
            slot, local = _PLAIN, g
        scaled.append(local)
        members = groups.get(slot)
        if members is None:
            groups[slot] = members = []
        members.append(_local_for_norm(g, slot) if slot.partial_dims else local)
        if local.dtype != norm_dtype:  # torch's total norm: the promotion of the dtypes
            norm_dtype = local.dtype if norm_dtype is None else torch.promote_types(
                norm_dtype, local.dtype)
    if _PLAIN in groups and len(groups) > 1:
        index = next(i for i, p in enumerate(params)
                     if p.grad is not None and not isinstance(p.grad, DTensor))
        raise TypeError(
            f"pycomm.clip_grad_norm_: parameters[{index}] has a plain "
            f"{type(params[index].grad).__name__} gradient among DTensor ones; it is unknown "
            f"whether its ranks hold copies or pieces of it. Clip it separately, or make it a "
            f"DTensor (e.g. fully_shard or replicate the module that owns it)")
    if not grads:  # a stage without gradients still takes its part in pp_mesh's all-reduce
        group = _as_group(pp_mesh)
        device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend(group) == "nccl" else torch.device("cpu")
        return {_PLAIN: torch.zeros(2, dtype=torch.float64, device=device)}, torch.float32, \
            lambda coef: None
    partials = {slot: ops.norm_partial(members, norm_type) if members else
                torch.zeros(2, dtype=torch.float64, device=scaled[0].device)
                for slot, members in groups.items()}
    return partials, norm_dtype, lambda coef: _scale(scaled, coef)


def _scale(tensors: list[torch.Tensor], coef: torch.Tensor) -> None:
    """ops.scale_ over `tensors`, one call per device."""
    device = tensors[0].device
    if all(t.device == device for t in tensors):
        ops.scale_(tensors, coef.to(device))
        return
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    for dev, ts in by_device.items():
        ops.scale_(ts, coef.to(dev))
