"""The one error type that means "the request was wrong", wherever it is raised.

Routes answer it as HTTP 400 naming the field; the engine answers it as a future whose error
category is ``user`` (the SDK raises it at once instead of retrying).
"""


class UserError(ValueError):
    """The request was wrong, not the server; the message names the field and why."""
