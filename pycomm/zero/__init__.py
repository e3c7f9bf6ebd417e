"""Sharded data parallelism: pycomm.ZeroRedundancyOptimizer.

  optimizer.py   the optimizer's front: constructor, step, zero_grad, the clip, the
                 scaler's unscale, add_param_group, join
  binding.py     whose parameters it shards: a pycomm DDP's (its hooks, re-cut, forward)
                 or its own, and where each piece's gradient is read
  flat.py        the flat parameter buffers, the pieces stepped, the all-gathers and tails
  layout.py      which elements each rank owns (flat shards of the buckets)
  hook.py        the DDP communication hook: a bucket reduce-scattered, the rank's shard
                 kept, the bucket freed
  checkpoint.py  the state dicts: consolidated, sharded, loaded onto any layout
  state.py       per-piece state against whole parameters' (pure functions)
  gathers.py     when the all-gathers ran and what the forward waited for
  grad_scaler.py torch's GradScaler over the shards (ShardedGradScaler)
"""

from .grad_scaler import ShardedGradScaler
from .optimizer import ELEMENTWISE, ZeroRedundancyOptimizer

__all__ = ["ELEMENTWISE", "ShardedGradScaler", "ZeroRedundancyOptimizer"]
