"""Harnesses for pycomm's own tests and benchmarks, shipped with a clone of the repository
and left out of the wheel (pyproject.toml): several hosts on one machine, made of network
namespaces joined by shaped links (hosts.py, root only), and the ranks run inside them
(hosts_launch.py)."""
