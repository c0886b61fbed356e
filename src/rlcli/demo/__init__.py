"""The demo (``rlcli demo``): SmolLM2 before and after SFT + RL on its own server."""
