"""Sharded data parallelism: pycomm.ZeroRedundancyOptimizer.

  optimizer.py   the optimizer: the layout of parameters and pieces, the sharded step,
                 the parameter all-gathers behind the forward, the clip
  layout.py      which elements each rank owns (flat shards of the buckets)
  adam_step.py   torch's Adam / AdamW stepped in one pass on CPU, where it gives their bits
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
