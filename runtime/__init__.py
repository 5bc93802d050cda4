"""The runtime: load a model, run its compiled steps, sample, stream text."""
from compiler.driver import BatchOptions

from .api import load, load_tokenizer
from .errors import RunError
from .model import Model
from .speculative import Speculation

__all__ = ["BatchOptions", "Model", "RunError", "Speculation", "load", "load_tokenizer"]
