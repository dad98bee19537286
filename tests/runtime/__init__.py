"""The runtime: persistence, a damaged or full state directory, closing, adoption, the
default model and GGUF, Ctrl-C, the trace."""
