"""Every file the docs and the comments name exists.

- docs/*.md and README.md: each path in backticks (`serve_app/routes.py`, `models/loader.py`,
  `tests/unit/test_layers.py::test_no_import_cycle`) names a file or folder of the repository: from the
  root when it starts with a top-level folder, else as the tail of one (`kernels/native_build.py`);
  each dotted name of ours in backticks (`serve_app.app:build_app`, `core.hashing.route_key`) names a
  module, and the name after it is defined there.
- every .py file: each `dir/file.ext` written in it (comments and docstrings) exists the same way.

Another project's file is named with its repository first (`vllm/entrypoints/openai/protocol.py`,
`llama.cpp/tools/server/server-schema.cpp`): a first folder that is none of ours is not checked.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "model_files", "replicas", "cache_router", "serve_app", "testing", "bench", "tests")
TOP_DIRS = PACKAGES + ("docs", "configs", "k8s", "docker", ".ci")
EXTENSIONS = ("py", "md", "yaml", "yml", "cpp", "h", "sh", "toml", "json", "jinja", "png", "txt")
SKIPPED = {".git", ".venv", "__pycache__", ".pytest_cache", "build", "node_modules"}
FILE_IN_TEXT = re.compile(r"(?<![\w./~$<:-])((?:[\w.-]+/)+[\w.-]+\.(?:%s))\b" % "|".join(EXTENSIONS))


def repo_files() -> list[str]:
    out = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if not SKIPPED.intersection(rel.parts) and not any(p.endswith(".egg-info") for p in rel.parts):
            out.append(rel.as_posix())
    return out


FILES = repo_files()
FILE_SET = set(FILES)


DIRS = {part for f in FILES for part in Path(f).parts[:-1]}


def exists(path: str) -> bool:
    """From the root when `path` starts with a top-level folder, else the tail of a repository path."""
    path = path.rstrip("/")
    if path.split("/")[0] in TOP_DIRS:
        return path in FILE_SET
    return any(f.endswith("/" + path) for f in FILES)


def is_ours(path: str) -> bool:
    """A path with a folder, whose first folder is one of ours (another project's starts with its own)."""
    return "/" in path and path.split("/")[0] in DIRS | set(TOP_DIRS)


def is_path(span: str) -> bool:
    if " " in span or any(c in span for c in "<>$*{}()=,'\"") or span.startswith(("/", "~", "http", "-")):
        return False
    if span.split("/")[0] in TOP_DIRS and "/" in span:
        return True
    return re.fullmatch(r"[\w./-]+\.(%s)" % "|".join(EXTENSIONS), span) is not None and is_ours(span)


def defines(module_path: Path, name: str) -> bool:
    """`name` is defined or imported at the top level of the module (def, class, assignment, import)."""
    pattern = rf"^(?:(?:async )?def|class)\s+{name}\b|^{name}\s*[:=]|^(?:from|import)\s[^\n]*\b{name}\b"
    return re.search(pattern, module_path.read_text(), re.M) is not None


def dotted_ok(span: str) -> bool:
    """`pkg.module[.name][:name]`: the longest module prefix exists and defines what follows."""
    parts = span.replace(":", ".").split(".")
    for cut in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:cut])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if module.is_file():
            rest = parts[cut:]
            return not rest or defines(module, rest[0])
    return False


def doc_spans(text: str) -> list[str]:
    return [s.strip().rstrip(":,.") for s in re.findall(r"`([^`\n]+)`", text)]


def missing_in_docs() -> list[str]:
    bad = []
    for doc in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]:
        for span in doc_spans(doc.read_text()):
            span = span.split("::")[0]
            if is_path(span) and not exists(span):
                bad.append(f"{doc.relative_to(ROOT)}: `{span}`")
            elif (re.fullmatch(r"[A-Za-z_][\w]*(\.[\w]+)+(:\w+)?", span) and span.split(".")[0] in PACKAGES
                  and not dotted_ok(span)):
                bad.append(f"{doc.relative_to(ROOT)}: `{span}`")
    return bad


def missing_in_code() -> list[str]:
    bad = []
    for rel in FILES:
        if not rel.endswith(".py") or rel == "tests/unit/test_docs_paths.py":  # names stale ones on purpose
            continue
        for match in FILE_IN_TEXT.finditer((ROOT / rel).read_text()):
            path = match.group(1)
            here = (Path(rel).parent / path).as_posix()
            if is_ours(path) and not exists(path) and here not in FILE_SET:
                bad.append(f"{rel}: {path}")
    return bad


def test_every_path_the_docs_name_exists():
    bad = missing_in_docs()
    assert not bad, "docs name paths that do not exist:\n" + "\n".join(bad)


def test_every_path_a_comment_names_exists():
    bad = missing_in_code()
    assert not bad, "source files name paths that do not exist:\n" + "\n".join(bad)


def test_the_checks_catch_a_stale_name():
    assert exists("serve_app/routes.py") and exists("kernels/native_build.py") and exists("tests/unit/")
    assert not exists("replicas/messages.py") and not exists("ARCHITECTURE.md")
    assert is_path("docs/metrics.md") and is_path("engine/request.py") and not is_path("/v1/chat/completions")
    assert not is_path("vllm/entrypoints/openai/protocol.py") and not is_path("config.json")
    assert dotted_ok("serve_app.app:build_app") and dotted_ok("core.hashing.route_key")
    assert not dotted_ok("cache_router.hashing") and not dotted_ok("serve_app.fanout.Dispatcher")
