"""Backends that run a model version: onnxruntime, pytorch (torch.export), embedding, llm."""
