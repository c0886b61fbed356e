"""The Tinker API's routes: training clients, sampling, checkpoints, REST for the CLI, service
calls; their typed bodies (``schemas.py``), request checks (``validate.py``) and the differences
between SDK generations (``generations.py``)."""
