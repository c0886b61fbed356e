"""What ties rlcli to the pinned tinker / tinker-cookbook versions (and SkyRL), one module per
thing adapted. Only ``pins`` and ``renderer_choice``/``renderers`` are below the server; the
hooks patch the cookbook in a recipe child and are imported there alone."""
