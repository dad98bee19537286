"""The runtime: persistence and adoption, the default model and GGUF, Ctrl-C, the trace."""
