"""The engine process and everything it computes: ``core.Engine`` (one base model, many LoRA
adapters) with its training half (``training.py``: every loss fused in one pass) and its sampling
paths (our decode step, continuous batching), behind the typed operations of ``ops.py``.

Kept empty: the HTTP process imports ``ops`` without loading the model's code."""
