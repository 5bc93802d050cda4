"""The tensor IR: types, graph, op registry, interpreter, printer, DOT export."""
from .graph import Graph, Node, Value, WeightRef
from .types import TensorType, f32, i32

__all__ = ["Graph", "Node", "Value", "WeightRef", "TensorType", "f32", "i32"]
