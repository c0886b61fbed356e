"""The layout's two rules, read from the source (no import runs): no import circle between
rlcli modules, and no import from a lower layer to a higher one (docs/architecture.md,
"Layers"). Function-level imports count: a circle hidden in a function is still a circle."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

# Top to bottom; a module may import its own layer or lower ones. The first pattern that
# matches a module (a name, or a package ending in ".") places it.
LAYERS = [
    ("entry points", ["rlcli.cli.", "rlcli.runs.child", "rlcli.server.__main__", "rlcli.api",
                      "rlcli"]),
    ("commands", ["rlcli.recipes.", "rlcli.demo.", "rlcli.client.evaluate", "rlcli.learn."]),
    ("runs", ["rlcli.runs."]),
    ("client", ["rlcli.client.", "rlcli.launch.", "rlcli.compat.run_hooks",
                "rlcli.compat.distill", "rlcli.compat.harbor_hooks",
                "rlcli.compat.skyrl_client", "rlcli.envs.", "rlcli.harbor.", "rlcli.traces."]),
    # The torch backend, below the Tinker API seam, in rooms of its own: the HTTP surface, what
    # the HTTP process keeps, the engine process, and the files and codecs both sides share.
    ("server http", ["rlcli.server.http."]),
    ("server state", ["rlcli.server.state."]),
    ("server engine", ["rlcli.server.engine."]),
    ("server store", ["rlcli.server.store.", "rlcli.server.wire", "rlcli.server.errors",
                      "rlcli.server"]),
    ("base", ["rlcli.models.", "rlcli.compat.", "rlcli.data.", "rlcli.files.",
              "rlcli.checkpoint_format", "rlcli.trace_format", "rlcli.errors", "rlcli.home",
              "rlcli.versions", "rlcli.runs.folder", "rlcli.flags"]),
]  # fmt: skip
# Known arrows against the order, each with its reason; the list only shrinks.
EXCEPTIONS: dict[tuple[str, str], str] = {}


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted((SRC / "rlcli").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(found: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the rlcli modules it imports (a package's ``__init__`` for a package)."""

    def known(name: str) -> str | None:
        while name and name not in found:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {}
    for module, path in found.items():
        out = edges.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                if name.startswith("rlcli.") or name == "rlcli":
                    target = known(name)
                    if target and target not in (module, "rlcli"):
                        out.add(target)
    return edges


def layer(module: str) -> int:
    for rank, (_, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            if (
                module == pattern
                or module == pattern.rstrip(".")
                or (pattern.endswith(".") and module.startswith(pattern))
            ):
                return rank
    raise AssertionError(f"{module} is in no layer: add it to LAYERS (and the architecture doc)")


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circle():
    assert circles(imports(modules())) == []


def test_every_module_has_a_layer():
    for module in modules():
        if module != "rlcli":
            layer(module)


def test_no_import_reaches_up_a_layer():
    edges = imports(modules())
    upward = sorted(
        f"{module} ({LAYERS[layer(module)][0]}) -> {target} ({LAYERS[layer(target)][0]})"
        for module, targets in edges.items()
        if module != "rlcli"
        for target in targets
        if layer(target) < layer(module) and (module, target) not in EXCEPTIONS
    )
    assert upward == []


def test_the_server_imports_no_client_code():
    """Outside server/: model names, the renderer choice (its OpenAI endpoint renders like
    ``train``), the pins, the tinker:// rules, the capture folder's format (the server writes
    what ``rlcli traces`` reads), whole-file writes, PII redaction (``serve start --capture
    --redact`` redacts what it records with the same library as ``rlcli redact``; it imports
    nothing of the client's); never a cookbook hook."""
    allowed = ("rlcli.models.", "rlcli.compat.pins", "rlcli.compat.renderer_choice",
               "rlcli.compat.renderers", "rlcli.checkpoint_format", "rlcli.trace_format",
               "rlcli.files.",
               "rlcli.errors", "rlcli.home", "rlcli.versions",
               "rlcli.data.redaction")  # fmt: skip
    edges = imports(modules())
    reached = sorted(
        f"{module} -> {target}"
        for module, targets in edges.items()
        if module.startswith("rlcli.server")
        for target in targets
        if not target.startswith("rlcli.server") and not target.startswith(allowed)
    )
    assert reached == []


def test_the_scan_sees_circles_and_upward_arrows():
    """The checks above would fail on what they look for (a scan that sees nothing passes)."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer("rlcli.server.http.app") > layer("rlcli.client.endpoint") > layer("rlcli.cli.main")
    assert layer("rlcli.compat.pins") > layer("rlcli.server.store.checkpoints")
    assert layer("rlcli.server.store.checkpoints") > layer("rlcli.server.engine.core")
    assert layer("rlcli.server.engine.core") > layer("rlcli.server.state.sessions")
    assert layer("rlcli.server.state.sessions") > layer("rlcli.server.http.app")
    stale = [pair for pair in EXCEPTIONS if pair[1] not in imports(modules()).get(pair[0], ())]
    assert stale == [], "an exception no longer needed: remove it"
