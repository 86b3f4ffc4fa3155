"""API fuzzing: schemathesis, as an outsider runs it, against Tether's own /openapi.json.

    .venv/bin/python -m bench.reliability.fuzz --max-examples 60   # the long run: >= 2,000 requests

Starts a LocalServer (the production routes over one in-process replica) on the tiny random-weight model,
then runs `schemathesis run` on its schema with every phase (examples, coverage, fuzzing, stateful) and
prints the responses by status, the checks' results and schemathesis' warnings. Imported by schemathesis
(SCHEMATHESIS_HOOKS=bench.reliability.fuzz), this module registers the run's extras: testing/fuzz_hooks.py's
`openai_error_shape` check and its `before_call` hook (max_tokens capped), and `after_call`, which tallies
every call for the summary.
"""

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import schemathesis

from bench.common import ROOT
from core.env import FUZZ_TALLY, fuzz_tally
from testing.fuzz_hooks import openai_error_shape

CHECKS = ",".join(["not_a_server_error", "status_code_conformance", "content_type_conformance",
                   "response_schema_conformance", "response_headers_conformance", openai_error_shape.__name__])


def start_server():
    from core.app_config import AppConfig
    from model_files.prepare import prepare_model
    from serve_app.local_server import LocalServer
    from testing.tiny_models import make_tiny_llama

    model_dir = make_tiny_llama(Path(tempfile.gettempdir()) / "tether-fuzz-tiny", prepare_model("default",
                                                                                               progress=False))
    return LocalServer(AppConfig(model=str(model_dir), served_model_name="tiny", dtype="float32"))


@schemathesis.hook
def after_call(context, case, response):
    """One line a call (method, path, generation mode, status) to $TETHER_FUZZ_TALLY, for summarize()."""
    tally = fuzz_tally()
    if tally:
        with open(tally, "a") as f:
            f.write(f"{case.method} {case.path} {case.meta.generation.mode.value} {response.status_code} "
                    f"{_blamed(response)}\n")


def _blamed(response) -> str:
    """The error's `param` ("-" for none or no error)."""
    try:
        return str((response.json().get("error") or {}).get("param") or "-").replace(" ", "_")
    except Exception:
        return "-"


def summarize(tally: Path) -> tuple[collections.Counter, collections.Counter, collections.Counter]:
    """Responses by status; by (route, generation mode, status class); positive cases refused, by param."""
    statuses, routes, refused = collections.Counter(), collections.Counter(), collections.Counter()
    for line in tally.read_text().splitlines():
        method, path, mode, status, param = line.split()
        statuses[int(status)] += 1
        if method == "POST":
            routes[f"{method} {path}", mode, f"{status[0]}xx"] += 1
        if mode == "positive" and status.startswith("4"):
            refused[param.split(".")[0].split("[")[0]] += 1
    return statuses, routes, refused


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-examples", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    server = start_server()
    out = Path(tempfile.mkdtemp(prefix="tether-fuzz-"))
    command = [str(Path(sys.executable).parent / "schemathesis"), "run", f"{server.base_url}/openapi.json",
               "--checks", CHECKS, "--max-examples", str(args.max_examples), "--seed", str(args.seed),
               "--workers", str(args.workers), "--request-timeout", "60"]
    # this module as schemathesis' hooks, by its import name (run as a script, __name__ is "__main__")
    env = {**os.environ, "SCHEMATHESIS_HOOKS": __spec__.name, "PYTHONPATH": str(ROOT),
           FUZZ_TALLY: str(out / "tally.txt")}
    start = time.perf_counter()
    try:
        rc = subprocess.call(command, env=env, cwd=out)  # its example database (.schemathesis/) goes there
    finally:
        server.stop()
    statuses, routes, refused = summarize(out / "tally.txt")
    print(f"\n{sum(statuses.values())} requests in {time.perf_counter() - start:.0f} s (schemathesis exit {rc}); "
          "by status: " + ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items())))
    for (route, mode, status), n in sorted(routes.items()):
        print(f"  {route:28} {mode:9} {status}: {n}")
    print("positive cases refused, by param: " + ", ".join(f"{k}: {n}" for k, n in refused.most_common()))
    return rc


if __name__ == "__main__":
    sys.exit(main())
