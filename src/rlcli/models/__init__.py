"""Base models: names (hub id, folder, .gguf), GGUF conversion, tokenizer repairs, the tiny
offline model."""
