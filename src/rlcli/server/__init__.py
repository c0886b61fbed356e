"""The ``torch`` backend: rlcli's own Tinker-API server (FastAPI + one engine process)."""
