"""Sharded data parallelism: pycomm.ZeroRedundancyOptimizer.

  layout.py     which elements each rank owns (flat shards of the buckets)
  optimizer.py  the optimizer: the reducer's reduce-scatter hook, the sharded step, the
                parameter all-gathers behind the forward
  state.py      state dicts: consolidated, sharded, re-cut onto another world size
"""

from .optimizer import ELEMENTWISE, ZeroRedundancyOptimizer

__all__ = ["ELEMENTWISE", "ZeroRedundancyOptimizer"]
