"""The runtime: load a model, run its compiled steps, sample, stream text."""
from compiler.driver import BatchOptions

from .model import Model, RunError, load, load_tokenizer
from .speculative import Speculation

__all__ = ["BatchOptions", "Model", "RunError", "Speculation", "load", "load_tokenizer"]
