"""Starting Tinker servers: our own (``torch_server``) or SkyRL's (``skyrl``), detached or in the
foreground, recorded and stopped (``process``). The compute itself is ``server/engine/core.py``."""
