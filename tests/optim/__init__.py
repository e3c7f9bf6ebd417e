"""pycomm.optim: torch's Adam and AdamW stepped in one pass (pycomm/optim.py)."""
