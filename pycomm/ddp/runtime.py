"""What pycomm's DistributedDataParallel builds around its C++ reducer, and rebuilds whole
with it (at construction, in _set_static_graph, after unpickling): the reducer, the
collectives around each forward (ForwardSync), the local clip's launch gate and the
per-bucket norms the DDP clip attaches. One owner: the module holds one Runtime, never
pickled (pickling.py), and a rebuild replaces it, so nothing attached to an old reducer
(a callback, a gate, norms) outlives it or is read against the new one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from .. import _C
from . import construction
from .args import gradient_group
from .clip import attach_local_clip
from .forward import ForwardSync

if TYPE_CHECKING:
    from .module import DistributedDataParallel


class Runtime:
    def __init__(self, ddp: DistributedDataParallel):
        gradient_pg = gradient_group(ddp.process_group, ddp.config, ddp.device)
        self.reducer = construction.build_reducer(ddp._named_params, gradient_pg,
                                                  ddp.process_group, ddp.config)
        self.sync = ForwardSync(self.reducer, ddp.module, ddp._delayed_names,
                                ddp._named_params, ddp.process_group, gradient_pg,
                                ddp.device, ddp.config)
        self.local_clip = attach_local_clip(self.reducer, ddp.config)
        self.bucket_norms = None  # attached by the DDP clip's first call

    def bucket_norm_partial(self, norm_type: float) -> Optional[torch.Tensor]:
        """The [acc, nonfinite] norm partial of the last synchronized backward's buckets,
        merged, or None when not every bucket's is there (the first call, which attaches
        the per-bucket norms to the reducer; another norm_type; a second call in one
        step). Later buckets are computed in `norm_type`."""
        if self.bucket_norms is None:
            self.bucket_norms = _C.attach_bucket_norms(self.reducer, norm_type)
            return None
        partial = self.bucket_norms.take(len(self.reducer.bucket_indices()), norm_type)
        self.bucket_norms.set_norm_type(norm_type)
        return partial
