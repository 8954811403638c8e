"""Tensor parallelism on torch.distributed: the rank's group and its collectives
(`parallel_state`), the worker processes and the executor that drives them."""
