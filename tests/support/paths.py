"""Where the repository is, for tests that run its scripts or read its files."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The repository root (holding pycomm/, tests/, examples/, benchmarks/)."""
