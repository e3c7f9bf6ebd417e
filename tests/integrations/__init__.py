"""pycomm inside the libraries that train with DDP, and pycomm.patch()."""
