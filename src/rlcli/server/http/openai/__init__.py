"""The OpenAI-compatible ``/v1``: chat and text completions (streaming too) and ``/v1/models``,
over the same engine and samplers as the Tinker API."""
