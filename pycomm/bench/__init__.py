"""pycomm-bench: one module per measured question; common.py holds launching and timing."""
