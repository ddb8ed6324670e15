"""Process groups for tensor / expert / data parallelism over torch.distributed."""
