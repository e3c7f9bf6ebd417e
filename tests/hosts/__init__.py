"""Several hosts on one machine (pycomm/hosts.py) and what runs across them."""
