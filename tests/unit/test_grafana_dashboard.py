"""docs/grafana/tether.json: a Grafana dashboard model whose every query names a series Tether exports.

All its series come from one scrape, Ray's metrics port on each node, so the exported names are read from
the code that defines them: each `ray.util.metrics` Counter / Gauge / Histogram created in
serve_app/metrics.py (the Ingress), replicas/metrics.py (the replicas) and cache_router/metrics.py (the
routers), found with `ast` (a string literal, or a name a `for` loop takes from a module-level dict of
literals), spelled as Ray exports them: `ray_` first, counters ending `_total`, histograms as `_bucket`,
`_sum` and `_count`. prometheus_client metrics of the same files are served at the Ingress's own
`GET /metrics`, not on Ray's port, so they do not count.
"""

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana" / "tether.json"
METRIC_SOURCES = ("serve_app/metrics.py", "replicas/metrics.py", "cache_router/metrics.py")
RAY_METRICS = "ray.util.metrics"
RAY_SUFFIXES = {"Counter": ("_total",), "Gauge": ("",), "Histogram": ("_bucket", "_sum", "_count")}


def ray_metrics_defined(source: str, filename: str) -> list[tuple[str, str]]:
    """(kind, base name) of every ray.util.metrics Counter / Gauge / Histogram created in `source`."""
    tree = ast.parse(source, filename)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    module_dicts = {target.id: node.value for node in tree.body if isinstance(node, ast.Assign)
                    and isinstance(node.value, ast.Dict) for target in node.targets if isinstance(target, ast.Name)}
    found = []
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        kind = ray_metric_class(call, parents, tree)
        if kind is None:
            continue
        if not call.args:
            raise AssertionError(f"{filename}:{call.lineno}: a {kind} without a positional name")
        found += [(kind, name) for name in metric_names(call.args[0], parents, module_dicts, filename)]
    return found


def ray_metric_class(call: ast.Call, parents: dict, tree: ast.Module) -> str | None:
    """'Counter' / 'Gauge' / 'Histogram' where `call` creates one from ray.util.metrics, else None. A name is
    looked up in the imports of the functions around the call, innermost first, then the module's."""
    func = call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):  # metrics.Counter(...)
        module, name = imported_as(func.value.id, call, parents, tree), func.attr
        return name if module == RAY_METRICS and name in RAY_SUFFIXES else None
    if isinstance(func, ast.Name):
        origin = imported_as(func.id, call, parents, tree)
        module, _, name = (origin or "").rpartition(".")
        return name if module == RAY_METRICS and name in RAY_SUFFIXES else None
    return None


def imported_as(alias: str, node: ast.AST, parents: dict, tree: ast.Module) -> str | None:
    """The dotted origin `alias` is bound to by an import in scope at `node` ('ray.util.metrics.Counter')."""
    scopes = []
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            scopes.append(node)
    scopes.append(tree)
    for scope in scopes:
        body = ast.walk(scope) if scope is not tree else iter(tree.body)
        for statement in body:
            if isinstance(statement, ast.ImportFrom) and statement.module:
                for name in statement.names:
                    if (name.asname or name.name) == alias:
                        return f"{statement.module}.{name.name}"
            elif isinstance(statement, ast.Import):
                for name in statement.names:
                    if name.asname == alias:
                        return name.name
    return None


def metric_names(arg: ast.expr, parents: dict, module_dicts: dict, filename: str) -> list[str]:
    """A string literal, or a loop variable of `for ... in DICT.items()` / `.values()` over a module-level dict
    whose values hold the name as a literal at the same place as the loop's target holds the variable."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return [arg.value]
    node = arg
    while isinstance(arg, ast.Name) and node in parents:
        node = parents[node]
        if not isinstance(node, ast.For):
            continue
        it = node.iter
        if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr in ("items", "values")
                and isinstance(it.func.value, ast.Name) and it.func.value.id in module_dicts):
            continue
        table = module_dicts[it.func.value.id]
        entries = [ast.Tuple([k, v]) for k, v in zip(table.keys, table.values)] if it.func.attr == "items" \
            else table.values
        path = path_to(node.target, arg.id)
        if path is not None:
            names = [literal_at(entry, path) for entry in entries]
            if all(isinstance(name, str) for name in names):
                return names
    raise AssertionError(f"{filename}:{arg.lineno}: cannot read the metric name {ast.unparse(arg)!r} statically; "
                         "name it with a string literal or a module-level dict of literals")


def path_to(target: ast.expr, name: str) -> list[int] | None:
    if isinstance(target, ast.Name):
        return [] if target.id == name else None
    if isinstance(target, ast.Tuple):
        for i, element in enumerate(target.elts):
            rest = path_to(element, name)
            if rest is not None:
                return [i, *rest]
    return None


def literal_at(node: ast.expr, path: list[int]):
    for i in path:
        if not isinstance(node, ast.Tuple) or i >= len(node.elts):
            return None
        node = node.elts[i]
    return node.value if isinstance(node, ast.Constant) else None


def exported_names() -> set[str]:
    names = set()
    for rel in METRIC_SOURCES:
        for kind, base in ray_metrics_defined((ROOT / rel).read_text(), rel):
            names |= {f"ray_{base}{suffix}" for suffix in RAY_SUFFIXES[kind]}
    return names


PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                   "offset", "inf", "nan"}


def queried_names(expr: str) -> set[str]:
    """The metric names of a PromQL expression: identifiers that are not a function (followed by `(`), a
    keyword, a label inside `{...}` / `by (...)`, a range `[...]`, or inside a string."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set(re.findall(r"(?<![\w.$])([A-Za-z_:][\w:]*)\b(?!\s*\()", expr))
    return {n for n in names if n.lower() not in PROMQL_KEYWORDS}


def unknown_names(dashboard: dict, exported: set[str]) -> list[str]:
    """'panel title: name' for every name a query asks for that nothing exports."""
    return [f"{panel['title']}: {name}" for panel in graph_panels(dashboard) for target in panel["targets"]
            for name in sorted(queried_names(target["expr"]) - exported)]


def graph_panels(dashboard: dict) -> list[dict]:
    return [panel for panel in dashboard["panels"] if panel["type"] != "row"]


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_the_collector_reads_each_kind_of_definition():
    """A literal name, a name from a dict of literals, Ray's class under an alias; prometheus_client's skipped."""
    source = (
        "import prometheus_client\n"
        "from prometheus_client import Counter\n"
        "TABLE = {'a': ('x_from_dict', 'doc'), 'b': ('y_from_dict', 'doc')}\n"
        "prom = Counter('served_at_the_ingress', 'doc')\n"
        "def make():\n"
        "    from ray.util.metrics import Counter, Histogram as H\n"
        "    import ray.util.metrics as m\n"
        "    for key, (name, description) in TABLE.items():\n"
        "        Counter(name, description)\n"
        "    H('h_literal', 'doc', boundaries=[1.0])\n"
        "    m.Gauge('g_literal', 'doc')\n")
    assert sorted(ray_metrics_defined(source, "example.py")) == [
        ("Counter", "x_from_dict"), ("Counter", "y_from_dict"), ("Gauge", "g_literal"), ("Histogram", "h_literal")]
    with pytest.raises(AssertionError, match="cannot read the metric name"):
        ray_metrics_defined("from ray.util.metrics import Gauge\nGauge(make_name(), 'doc')\n", "example.py")


def test_the_dashboard_is_a_grafana_model():
    dashboard = load()
    assert dashboard["uid"] and dashboard["title"] and isinstance(dashboard["schemaVersion"], int)
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), f"panel ids repeat: {ids}"
    cells = set()
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["y"] >= 0 and grid["w"] > 0 and grid["h"] > 0
        assert grid["x"] + grid["w"] <= 24, f"{panel['title']}: wider than Grafana's 24 columns"
        covered = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                   for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not cells & covered, f"{panel['title']} overlaps another panel"
        cells |= covered
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["replica"]["type"] == "query" and variables["replica"]["includeAll"]
    for panel in graph_panels(dashboard):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], f"{panel['title']}: no query"
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), f"{panel['title']}: refIds repeat"
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), f"{panel['title']}: {target['expr']}"


# what each required panel must query: every name of a set, in one panel
REQUIRED_PANELS = {
    "time to first token": {"ray_tether_time_to_first_token_seconds_bucket"},
    "inter-token latency": {"ray_tether_inter_token_latency_seconds_bucket"},
    "tokens per second": {"ray_tether_completion_tokens_total", "ray_tether_prompt_tokens_total"},
    "requests by status": {"ray_tether_requests_total"},
    "queue depth": {"ray_tether_requests_in_flight", "ray_tether_replica_waiting_sequences",
                    "ray_tether_replica_running_sequences"},
    "cached share": {"ray_tether_replica_prompt_tokens_cached_total",
                     "ray_tether_replica_prompt_tokens_computed_total"},
    "KV use": {"ray_tether_replica_kv_blocks_used", "ray_tether_replica_kv_blocks_capacity"},
    "router predicted vs delivered": {"ray_tether_router_predicted_cached_tokens_total",
                                      "ray_tether_replica_predicted_cached_tokens_total",
                                      "ray_tether_replica_delivered_cached_tokens_total"},
    "shortfall": {"ray_tether_replica_cache_shortfall_tokens_total"},
    "forgone": {"ray_tether_router_forgone_cached_tokens_total"},
    "policy steps": {"ray_tether_router_requests_total"},
}


@pytest.mark.parametrize("what", sorted(REQUIRED_PANELS))
def test_the_dashboard_has_the_panel(what):
    wanted = REQUIRED_PANELS[what]
    panels = [panel for panel in graph_panels(load())
              if wanted <= {n for target in panel["targets"] for n in queried_names(target["expr"])}]
    assert panels, f"no panel queries {sorted(wanted)} ({what})"


@pytest.mark.parametrize("metric", ["ray_tether_time_to_first_token_seconds", "ray_tether_inter_token_latency_seconds"])
def test_the_latency_panels_show_p50_p95_p99(metric):
    exprs = [target["expr"] for panel in graph_panels(load()) for target in panel["targets"]
             if f"{metric}_bucket" in target["expr"]]
    quantiles = {float(q) for expr in exprs
                 for q in re.findall(rf"histogram_quantile\(\s*([\d.]+),[^;]*\b{metric}_bucket\b", expr)}
    assert quantiles == {0.5, 0.95, 0.99}, exprs
    assert all(re.search(r"sum by \((\w+, )*le(, \w+)*\)", expr) for expr in exprs), "quantiles need `by (le)`"


def test_every_queried_metric_is_exported():
    exported = exported_names()
    unknown = unknown_names(load(), exported)
    assert not unknown, "the dashboard queries metrics that no ray.util.metrics definition exports:\n" + \
        "\n".join(unknown)


def test_the_name_check_catches_a_misspelled_metric():
    dashboard = load()
    target = graph_panels(dashboard)[0]["targets"][0]
    name = sorted(queried_names(target["expr"]))[0]
    target["expr"] = target["expr"].replace(name, name.replace("tether", "tehter"))
    assert unknown_names(dashboard, exported_names()) == [
        f"{graph_panels(dashboard)[0]['title']}: {name.replace('tether', 'tehter')}"]
    assert queried_names('sum by (le) (rate(ray_x_bucket{replica=~"$replica", le="+Inf"}[$__rate_interval])) '
                         '/ on (replica) group_left ray_y offset 5m') == {"ray_x_bucket", "ray_y"}
