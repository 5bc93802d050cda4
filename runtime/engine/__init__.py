"""The batch engine (``lmc serve``): continuous batching over a paged KV pool."""
from .loading import BatchModel, load_batch_model

__all__ = ["BatchModel", "load_batch_model"]
