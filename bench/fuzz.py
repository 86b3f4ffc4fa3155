"""API fuzzing: schemathesis, as an outsider runs it, against Tether's own /openapi.json.

    .venv/bin/python bench/fuzz.py --max-examples 60      # the long run (>= 2,000 requests when no check fails)

Starts a LocalServer (the production routes over one in-process replica) on the tiny random-weight model,
then runs `schemathesis run` on its schema with every phase (examples, coverage, fuzzing, stateful) and
prints the responses by status, the checks' results and schemathesis' warnings. Imported by schemathesis
(SCHEMATHESIS_HOOKS=bench.fuzz), this module also registers the run's two extras:
- `openai_error_shape`: every 4xx/5xx is {"error": {message, type, param, code}}, and a 400 for a JSON
  object names a `param` (a body that is no JSON object has no field to blame);
- `before_call`: max_tokens capped at MAX_TOKENS (the engine runs on 2 cores), valid values only, so a
  negative case stays negative.
"""

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import schemathesis

MAX_TOKENS = 8
CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,"
          "response_headers_conformance,openai_error_shape")


@schemathesis.check
def openai_error_shape(ctx, response, case):
    if response.status_code < 400:
        return None
    error = response.json().get("error") if "json" in response.headers.get("content-type", [""])[0] else None
    assert isinstance(error, dict) and set(error) >= {"message", "type", "param", "code"}, \
        f"not OpenAI's error shape: {response.text[:200]}"
    sent_json = response.request.headers.get("Content-Type", "").startswith("application/json")
    if response.status_code == 400 and isinstance(case.body, dict) and sent_json:
        assert isinstance(error["param"], str) and error["param"], f"a 400 without a param: {error}"
    return None


def _is_valid_count(value, low: int, high: int) -> bool:
    """An integer the server accepts as a count: an int, or a float with an integral value (436.0: pydantic
    takes it as 436, so it must be capped too, or a case asks for n x 436 tokens)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


@schemathesis.hook
def before_call(context, case, kwargs):
    body = case.body
    if not isinstance(body, dict) or not case.path.endswith("completions"):
        return
    for name in ("max_tokens", "max_completion_tokens"):
        if name not in body or body[name] is None:
            body[name] = MAX_TOKENS
        elif _is_valid_count(body[name], 1, 1 << 31):
            body[name] = min(body[name], MAX_TOKENS)
    if _is_valid_count(body.get("min_tokens"), 0, 1 << 31):
        body["min_tokens"] = min(body["min_tokens"], MAX_TOKENS)


def start_server():
    sys.path.insert(0, str(Path(__file__).parents[1]))  # testing.tiny_models
    from model_files.prepare import prepare_model
    from core.app_config import AppConfig
    from serve_app.local_server import LocalServer
    from testing.tiny_models import make_tiny_llama

    model_dir = make_tiny_llama(Path(tempfile.gettempdir()) / "tether-fuzz-tiny", prepare_model("default",
                                                                                               progress=False))
    return LocalServer(AppConfig(model=str(model_dir), served_model_name="tiny", dtype="float32"))


@schemathesis.hook
def after_call(context, case, response):
    """One line a call (method, path, generation mode, status) to $TETHER_FUZZ_TALLY, for summarize()."""
    tally = os.environ.get("TETHER_FUZZ_TALLY")
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
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "bench.fuzz", "PYTHONPATH": str(Path(__file__).parents[1]),
           "TETHER_FUZZ_TALLY": str(out / "tally.txt")}
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
