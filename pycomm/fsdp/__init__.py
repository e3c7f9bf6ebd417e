"""pycomm for FSDP2 (`fully_shard`) and `replicate` users: clip_grad_norm_ on their DTensor
gradients (pycomm/fsdp/clip.py)."""
