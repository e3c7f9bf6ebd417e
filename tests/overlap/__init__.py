"""Overlap reports, traces and the alpha-beta model (pycomm/overlap/)."""
