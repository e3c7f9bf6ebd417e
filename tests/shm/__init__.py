"""The "pycomm" shared-memory backend (pycomm/shm.py, csrc/shm/)."""
