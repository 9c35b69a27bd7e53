"""Asynchronous, distributed checkpointing built on torch.distributed.checkpoint."""
