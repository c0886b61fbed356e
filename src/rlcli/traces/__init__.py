"""Captured traffic as data: the traces ``serve start --capture`` wrote and their verdicts
(``POST /v1/feedback``), read and filtered (``catalog.py``) and turned into the rows the train
commands read (``export.py``). ``rlcli traces`` is the thin CLI over it; the file format is
``rlcli.trace_format``'s (docs/traces.md)."""
