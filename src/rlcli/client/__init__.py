"""Talking to a Tinker server as a client: which server (endpoint), sample and chat, export
and restore, GGUF export, eval."""
