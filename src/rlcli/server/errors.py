"""The one error type that means "the request was wrong", wherever it is raised.

Raised in a route (or by ``wire``, ``validate``, ``checkpoints`` under one), ``app.py`` answers
it as HTTP 400 with its message; raised in the engine, the future fails with category
``user`` (the SDK raises it at once instead of retrying). Subclasses say where it came from.
"""


class UserError(ValueError):
    """The request was wrong, not the server; the message names the field and why."""
