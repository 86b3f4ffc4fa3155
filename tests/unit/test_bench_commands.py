"""Every bench command the docs quote runs as written, as far as its arguments go.

In the code of docs/*.md and README.md (fenced blocks and backtick spans):
- `python -m bench.<folder>.<name> ARGS`: the module runs with ARGS + `--help` and exits 0, and its help names
  every option ARGS uses (argparse checks the values before `--help`; an unknown option it would only report
  after, so the help text is checked for it);
- `bash bench/<folder>/<name>.sh ARGS`: the script exists and parses (`bash -n`), every module it runs exists,
  and each such module takes ARGS as above (the scripts pass their arguments on);
- no bench script is quoted the old way (`python bench/<name>.py`), and every bench module that runs as a
  script (has a `__main__` block) is quoted at least once.
One subprocess imports and runs every module (runpy, in turn), so that torch and the rest load once. Without
CUDA, the GPU check's command, given no arguments, also says so there and exits 0.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
ARGS = r"((?:[ \t]+[^\s;&|()#`]+)*)"  # a command's arguments, up to a shell operator, a comment or the code's end
MODULE_COMMAND = re.compile(r"python3?\s+-m\s+(bench(?:\.\w+)+)" + ARGS)
SHELL_COMMAND = re.compile(r"bash\s+(bench/[\w/]+\.sh)" + ARGS)
OLD_FORM = re.compile(r"python3?\s+(?:\S*/)?bench/\S*\.py")
GPU_CHECK = "bench.gpu.gpu_check"

# Runs each [module, argv] of the JSON list in argv[1] as `python -m` would, and writes [code, output] of
# each to the file named by argv[2].
RUNNER = """
import contextlib, io, json, runpy, sys

cases, results_file, results = json.loads(sys.argv[1]), sys.argv[2], []
for module, args in cases:
    sys.argv = [module, *args]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
        except BaseException as error:
            code = repr(error)
    results.append([code, out.getvalue()])
with open(results_file, "w") as f:
    json.dump(results, f)
"""


def quoted_code(doc: Path) -> list[str]:
    """The fenced code blocks and the backtick spans of a Markdown file."""
    text = doc.read_text()
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.M | re.S)
    return blocks + re.findall(r"`([^`\n]+)`", prose)


def arguments(text: str) -> list[str]:
    """A quoted command's arguments; `[--opt value]` (optional, as usage lines write it) counts as given."""
    return text.replace("[", " ").replace("]", " ").split()


def quoted_commands() -> tuple[set[tuple[str, tuple]], set[tuple[str, tuple]], list[str]]:
    """What the docs quote: module commands and shell commands, (module or script, arguments) each, and the
    old-form commands, each with its file."""
    modules, scripts, old = set(), set(), []
    for doc in DOCS:
        for code in quoted_code(doc):
            modules |= {(m.group(1), tuple(arguments(m.group(2)))) for m in MODULE_COMMAND.finditer(code)}
            scripts |= {(m.group(1), tuple(arguments(m.group(2)))) for m in SHELL_COMMAND.finditer(code)}
            old += [f"{doc.relative_to(ROOT)}: {m.group(0)}" for m in OLD_FORM.finditer(code)]
    return modules, scripts, old


def modules_run_by(script: str) -> list[str]:
    return re.findall(r"-m\s+(bench(?:\.\w+)+)", (ROOT / script).read_text())


def module_file(module: str) -> Path:
    return ROOT.joinpath(*module.split(".")).with_suffix(".py")


def cases() -> list[tuple[str, tuple]]:
    """Every (module, quoted arguments) to run with `--help` appended: quoted directly or through a script."""
    modules, scripts, _ = quoted_commands()
    through_scripts = {(module, args) for script, args in scripts for module in modules_run_by(script)}
    return sorted(modules | through_scripts)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[tuple[str, tuple], tuple]:
    """(module, quoted arguments) -> (exit code, output) of each case with `--help`; the GPU check without
    arguments too, where there is no CUDA."""
    argvs = [[module, [*args, "--help"]] for module, args in cases()]
    if not torch.cuda.is_available():
        argvs.append([GPU_CHECK, []])
    out = tmp_path_factory.mktemp("bench-commands") / "results.json"
    subprocess.run([sys.executable, "-c", RUNNER, json.dumps(argvs), str(out)], cwd=ROOT, check=True,
                   timeout=300)
    results = json.loads(out.read_text())
    keys = [(module, tuple(args)) for module, args in argvs]
    return dict(zip(keys, map(tuple, results)))


def test_every_quoted_module_command_answers_help_with_its_arguments(runs):
    assert cases(), "no bench command found in the docs"
    bad = []
    for module, args in cases():
        code, output = runs[module, (*args, "--help")]
        options = [a.split("=")[0] for a in args if a.startswith("--")]
        unknown = [o for o in options if not re.search(re.escape(o) + r"(?![\w-])", output)]
        if code != 0 or unknown:
            bad.append(f"python -m {module} {' '.join(args)}: exit {code}, options not in its help {unknown}\n"
                       f"{output[-2000:]}")
    assert not bad, "\n\n".join(bad)


def test_every_quoted_script_exists_parses_and_runs_modules_that_exist():
    _, scripts, _ = quoted_commands()
    assert scripts, "no bench shell script found in the docs"
    for script in {script for script, _ in scripts}:
        assert (ROOT / script).is_file(), script
        assert subprocess.run(["bash", "-n", str(ROOT / script)]).returncode == 0, script
        assert modules_run_by(script), f"{script} runs no bench module"
        for module in modules_run_by(script):
            assert module_file(module).is_file(), f"{script} runs {module}, which does not exist"


def test_no_bench_script_is_quoted_the_old_way():
    _, _, old = quoted_commands()
    assert not old, "quote these as `python -m bench.<folder>.<name>`:\n" + "\n".join(old)


def test_every_bench_script_is_quoted():
    quoted = {module for module, _ in cases()}
    runnable = {".".join(path.relative_to(ROOT).with_suffix("").parts) for path in (ROOT / "bench").rglob("*.py")
                if 'if __name__ == "__main__":' in path.read_text()}
    assert runnable <= quoted, f"bench scripts no doc quotes a command of: {sorted(runnable - quoted)}"


def test_the_gpu_check_without_cuda_says_so_and_succeeds(runs):
    if torch.cuda.is_available():
        pytest.skip("CUDA here: the GPU check would run for real")
    code, output = runs[GPU_CHECK, ()]
    assert code == 0 and "no CUDA" in output, output


def test_the_extraction_sees_what_the_docs_write():
    code = quoted_code(ROOT / "docs" / "benchmarks.md")
    assert any("python -m bench.engine.throughput" in c for c in code) and any("`" not in c for c in code)
    found = MODULE_COMMAND.search("(cd /tmp/old && python -m bench.engine.profile_step --top 0); python -m x")
    assert found.group(1) == "bench.engine.profile_step" and arguments(found.group(2)) == ["--top", "0"]
    assert arguments(" --runs 3 [--dtype float32]") == ["--runs", "3", "--dtype", "float32"]
    assert OLD_FORM.search("PYTHONPATH=/tmp/old python /tmp/old/bench/profile_step.py --top 0")
