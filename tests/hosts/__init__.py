"""Several hosts on one machine (pycomm/testing/hosts.py) and what runs across them."""
