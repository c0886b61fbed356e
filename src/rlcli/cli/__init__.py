"""The ``rlcli`` command: thin over the library. Each command imports its library inside its
function (lazy: ``rlcli --help`` and every command load only what they run; the library pulls
in httpx, tinker, the cookbook, torch)."""
