"""Checkpoints on disk (``checkpoints.py``: the ``tinker://`` names, atomic versions, sweeps) and
the tar archives built from them for downloads (``archives.py``)."""
