"""``rlcli learn``: the continual-learning loop (round.py), its traces, gate and report."""
