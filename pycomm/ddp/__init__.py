"""pycomm's DistributedDataParallel, one job per module:

  module.py        the nn.Module itself: puts the pieces together, torch's DDP API
  args.py          torch's constructor arguments: refusals, the config, the groups
  construction.py  which tensors are reduced or synchronized, devices, the first
                   state sync, the reducer and its first bucket layout
  forward.py       the collectives around each forward (bucket rebuild, buffer sync,
                   join's flags), for the module and for a joined rank alike
  join.py          uneven inputs: the hook a joined rank runs
  delay.py         delay_all_reduce_named_params: the delayed parameters' all-reduce
  pickling.py      what torch.save keeps and what an unpickled module rebuilds
  compat.py        what code written for torch's DDP (Lightning, Accelerate, the HF
                   Trainer, torch itself) reads off the module and its reducer
  compile.py       what torch.compile sees of the forward, the graph split at buckets
  runtime.py       the reducer and what is rebuilt with it (ForwardSync, the clips),
                   left out of pickling in one place
  clip.py          the DDP clip (after the all-reduce) and the local clip (before it)

Helpers are handed what they use (the reducer, the groups, a ForwardSync); none imports
module.py (tests/packaging/test_import_cycles.py checks that no import cycle forms)."""

from .module import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
