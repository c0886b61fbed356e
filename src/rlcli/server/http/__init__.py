"""The HTTP surface of the torch backend: the FastAPI app (``app.py``), the Tinker API's routes and
bodies for every SDK generation (``tinker/``) and the OpenAI-compatible ``/v1`` (``openai/``).

A route validates a typed body, records what the HTTP process keeps (``server/state``) and queues
a typed operation on the engine (``server/engine/ops.py``); nothing here computes on the model.
"""
