"""pycomm/ddp/: DistributedDataParallel against torch's, its faults and options."""
