"""pycomm.ZeroRedundancyOptimizer's state dicts: consolidated (a plain optimizer's),
sharded (a rank's pieces), and loading either, or every rank's shards, onto this layout
(See Note [Piece state] in state.py). A mixin of the optimizer: it reads the optimizer's
pieces, wrapped optimizer and groups."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from .layout import Piece
from .state import MAIN_KEY, SHARD_FORMAT, cut_state, shard_runs, whole_states


class ShardedStateDicts:

    def _my_runs(self) -> list[tuple[Piece, dict]]:
        """This rank's pieces (its range and the tail) with their state."""
        out = []
        for _, piece, main in self._pieces:
            state = dict(self.optim.state.get(main, {}))
            if main.dtype != self._params[piece.param].dtype:
                state[MAIN_KEY] = main  # the fp32 main parameter: no copy of it elsewhere
            if state:
                out.append((piece, state))
        return out

    def _whole_states(self, to: Optional[int] = None) -> Optional[dict[int, dict]]:
        """Every parameter's whole state (See Note [Piece state]), on every rank or on
        group rank `to` only. Collective."""
        mine = [((p.param, p.lo, p.hi, p.flat), s) for p, s in self._my_runs()]
        shapes = [p.shape for p in self._params]
        if to is None:
            everyone: list = [None] * self.world_size
            dist.all_gather_object(everyone, mine, group=self._comm_group)
        else:
            everyone = [None] * self.world_size if self.rank == to else None
            dist.gather_object(mine, everyone, dst=dist.get_global_rank(self._comm_group, to),
                               group=self._comm_group)
            if self.rank != to:
                return None
        runs = [(Piece(*p), s) for rank_runs in everyone for p, s in rank_runs]
        return whole_states(runs, shapes)

    def _load_whole(self, whole: dict[int, dict]) -> None:
        inner = self.optim.state_dict()
        index = {}
        k = 0
        for group in self.optim.param_groups:
            for t in group["params"]:
                index[id(t)] = k
                k += 1
        state = {}
        for _, piece, main in self._pieces:
            if piece.param in whole:
                cut = cut_state(whole[piece.param], piece, self._params[piece.param].shape)
                saved_main = cut.pop(MAIN_KEY, None)
                if saved_main is not None and main.dtype != self._params[piece.param].dtype:
                    main.copy_(saved_main)
                if cut:
                    state[index[id(main)]] = cut
        inner["state"] = state
        self.optim.load_state_dict(inner)

    def _number(self) -> dict[int, int]:
        """Reducer index -> torch's state-dict number (order in param_groups)."""
        number, k = {}, 0
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) in self._index:  # not a frozen parameter outside the DDP
                    number[self._index[id(p)]] = k
                k += 1
        return number

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole optimizer state on group rank `to`; its state_dict() then
        returns what optimizer_class's own state_dict() would. Collective."""
        self._follow_buckets()
        whole = self._whole_states(to)
        self._consolidated = None
        if whole is None:
            return
        number = self._number()
        self._consolidated = {"state": {number[i]: s for i, s in sorted(whole.items())},
                              "param_groups": self._numbered_groups()}

    def _numbered_groups(self) -> list[dict]:
        """param_groups as torch's state_dict() writes them: parameters numbered in order."""
        groups, k = [], 0
        for group in self.param_groups:
            g = {key: v for key, v in group.items() if key != "params"}
            g["params"] = list(range(k, k + len(group["params"])))
            k += len(group["params"])
            groups.append(g)
        return groups

    def state_dict(self) -> dict[str, Any]:
        """torch's: the consolidated state dict, on the rank consolidate_state_dict sent it
        to; call that first, on every rank. Before any rank holds state (nothing stepped or
        loaded: the same on every rank) there is nothing to consolidate, and every rank
        returns the stateless dict, as Accelerate's prepare() reads it."""
        consolidated = getattr(self, "_consolidated", None)
        if consolidated is None and not self._holds_state:
            return {"state": {}, "param_groups": self._numbered_groups()}
        if consolidated is None:
            raise RuntimeError(
                f"ZeroRedundancyOptimizer (rank {self.global_rank}): call "
                f"consolidate_state_dict(to=...) on every rank first; only the rank it names "
                f"gets the state dict (or save sharded_state_dict() on every rank)")
        return consolidated

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's own pieces (its range and the tail) and their state: what each rank
        saves for a sharded checkpoint. load_state_dict takes it back on the same world
        size, or every rank's list of them on any world size."""
        self._follow_buckets()
        runs = self._my_runs()
        return {"format": SHARD_FORMAT, "world_size": self.world_size, "rank": self.rank,
                "signature": self._signature,
                "pieces": [(p.param, p.lo, p.hi, p.flat) for p, _ in runs],
                "state": [{k: v.clone() if isinstance(v, torch.Tensor) else v
                           for k, v in s.items()} for _, s in runs],
                "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                 for g in self.param_groups]}

    def load_state_dict(self, state_dict: Any) -> None:
        """A consolidated state dict (a plain optimizer_class's, from any world size), this
        rank's own sharded_state_dict() (same world size; collective when the buckets
        differ from the saving run's), or the list of every rank's sharded_state_dict()
        (any world size)."""
        self.wait_for_params()
        shapes = [p.shape for p in self._params]
        if isinstance(state_dict, list):
            runs = [r for shard in state_dict for r in shard_runs(shard)]
            groups = state_dict[0]["param_groups"] if state_dict else []
            whole = whole_states(runs, shapes)
        elif isinstance(state_dict, dict) and "format" in state_dict:
            runs, groups = self._own_shard_runs(state_dict)
            whole = whole_states(runs, shapes)
        else:
            number = self._number()
            saved = state_dict["state"]
            groups = state_dict["param_groups"]
            if len(groups) != len(self.param_groups):
                raise ValueError(f"loaded state dict has {len(groups)} parameter groups, "
                                 f"the optimizer {len(self.param_groups)}")
            whole = {i: saved[n] for i, n in number.items() if n in saved}
        for group, saved in zip(self.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self._holds_state = True
        self._relayout(whole)

    def _own_shard_runs(self, shard: dict) -> tuple[list, list]:
        """load_state_dict of a rank's own sharded dict: every rank checks every rank's
        (one all-gather of what each passed, so that a bad one fails them all, naming it,
        rather than leaving the others in a collective); saved on other buckets (before
        the DDP's re-cut, say), the ranks exchange their shards. Collective."""
        mine = (shard.get("format") == SHARD_FORMAT, shard.get("world_size"), shard.get("rank"),
                tuple(map(tuple, shard.get("signature", ()))))
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self._comm_group)
        wrong = [f"rank {r} passed " + (f"the shard of rank {k} of {w}" if ok else
                                        "something that is not a sharded state dict")
                 for r, (ok, w, k, _) in enumerate(everyone)
                 if not ok or (w, k) != (self.world_size, r)]
        if wrong:
            raise ValueError(
                f"ZeroRedundancyOptimizer (rank {self.rank} of {self.world_size}): "
                f"{'; '.join(wrong)}. Load each rank's own shard on the same world size, or "
                f"pass the list of every rank's shards (any world size)")
        runs = shard_runs(shard)
        if any(sig != self._signature for *_, sig in everyone):
            shards: list = [None] * self.world_size
            dist.all_gather_object(shards, shard, group=self._comm_group)
            runs = [r for other in shards for r in shard_runs(other)]
        return runs, shard["param_groups"]
