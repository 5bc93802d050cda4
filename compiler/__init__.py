"""The compiler: model loading, the pass pipeline and (later) native code."""
