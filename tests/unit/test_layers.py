"""The layers docs/architecture.md names, checked against the imports the code makes.

The table under "## Layers" in docs/architecture.md says, for each layer, the modules it holds and the
layers it may import. This walks every import of every module (module level and inside functions; a
`TYPE_CHECKING` import counts too) and fails on an import the table does not allow, on a module no layer
holds, and on an import cycle between modules."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OURS = ("core", "model_files", "replicas", "cache_router", "serve_app", "testing", "bench", "tests")


def layer_table() -> dict[str, tuple[list[str], set[str]]]:
    """{layer: ([module prefixes], {layers it may import})}, from docs/architecture.md."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("\n## Layers", 1)[1].split("\n## ", 1)[0]
    table = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("**"):
            continue
        name = cells[0].strip("*")
        table[name] = (re.findall(r"`([\w.]+)`", cells[1]), set(re.findall(r"\*\*(\w+)\*\*", cells[2])))
    return table


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Every one of our modules `path` imports, resolved (relative imports too). `from pkg import name`
    imports the module pkg.name where there is one, else pkg (a name defined in it)."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module)
    return {m for m in found if m in modules and m != name}


def module_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for top in OURS for p in (ROOT / top).rglob("*.py")}
    return {name: imports_of(path, set(paths)) for name, path in paths.items()}


def layer_of(module: str, table) -> str | None:
    """The layer whose longest prefix holds `module`."""
    best, best_len = None, -1
    for layer, (prefixes, _) in table.items():
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = layer, len(prefix)
    return best


def test_the_table_is_there():
    table = layer_table()
    assert {"core", "model_files", "kernels", "models", "sampling", "request", "cache", "engine", "replica",
            "router", "ingress", "app", "testing", "tests", "bench"} <= set(table)
    for layer, (_, allowed) in table.items():
        assert allowed <= set(table), f"{layer} may import an unknown layer: {allowed - set(table)}"


def test_every_import_goes_down_the_table():
    table = layer_table()
    graph = module_graph()
    homeless = sorted(m for m in graph if layer_of(m, table) is None)
    assert not homeless, f"modules no layer holds: {homeless}"
    wrong = []
    for module, targets in graph.items():
        layer = layer_of(module, table)
        for target in targets:
            to = layer_of(target, table)
            if to != layer and to not in table[layer][1]:
                wrong.append(f"{module} ({layer}) imports {target} ({to})")
    assert not wrong, "imports the layer table does not allow:\n" + "\n".join(sorted(wrong))


def test_no_import_cycle():
    graph = module_graph()
    cycles = strongly_connected(graph)
    assert not cycles, f"import cycles: {cycles}"


def test_a_wrong_import_would_be_caught(tmp_path):
    """The walk sees an upward import: core importing the engine is outside the table."""
    table = layer_table()
    assert layer_of("core.messages", table) == "core"
    assert "replicas" not in table["core"][1] and layer_of("replicas.engine.engine", table) != "core"
    cyclic = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert [sorted(c) for c in strongly_connected(cyclic)] == [["a", "b", "c"]]


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
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
                    work.append((child, iter(sorted(graph.get(child, ())))))
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
                    out.append(component)
    return out
