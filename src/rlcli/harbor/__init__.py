"""Harbor tasks on a local Docker daemon: agent RL where a task is a container, an instruction
and a test script, and the test's verdict is the reward (``rlcli train harbor``).

- ``tasks``: task folders in Harbor's format, loaded and validated (one clear error per
  folder), filtered; ``name@version`` datasets resolved in the Harbor cache (downloaded with
  ``uvx harbor`` when missing).
- ``docker``: the sandbox the cookbook's ``recipes/harbor_rl`` drives (``SandboxInterface``):
  one container per rollout from an image tagged by the environment folder's content hash,
  with the task's limits, no network unless asked, command timeouts, capped output, and
  cleanup by label on every way out.
- ``verifier``: Harbor's reward (upload ``tests/``, run ``test.sh``, read
  ``/logs/verifier/reward.txt`` or ``reward.json``); a broken verifier is reward 0 and a
  logged error, never a crash.

Nothing here imports torch or tinker at module top.
"""
