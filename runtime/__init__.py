"""The runtime: load a model, run its compiled steps, sample, stream text."""
from .model import Model, RunError, load, load_tokenizer

__all__ = ["Model", "RunError", "load", "load_tokenizer"]
