"""Gradient clipping and the fused ops (pycomm/clip.py, pycomm/ops.py, csrc/grad/)."""
