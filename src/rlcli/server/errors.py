"""The one error type that means "the request was wrong", wherever it is raised.

Raised in a route (or by ``wire``, ``validate``, ``checkpoints`` under one), ``http/app.py`` answers
it with its ``status`` and message; raised in the engine, the future fails with category
``user`` (the SDK raises it at once instead of retrying). Subclasses say where it came from.
"""


class UserError(ValueError):
    """The request was wrong, not the server; the message names the field and why.

    ``status`` is the HTTP answer in a route: 400 for a request the server will not honour,
    422 (subclasses) for a payload that does not validate, as FastAPI servers such as SkyRL's
    answer malformed bodies."""

    status = 400


class InvalidPayload(UserError):
    """The request body does not parse or validate (a field's type, range or shape)."""

    status = 422
