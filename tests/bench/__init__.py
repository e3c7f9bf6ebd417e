"""The pycomm-bench CLI (pycomm/bench/) and the scripts under benchmarks/."""
