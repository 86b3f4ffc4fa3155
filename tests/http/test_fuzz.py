"""A bounded schemathesis run against the served /openapi.json (bench/reliability/fuzz.py is the long one).

Every route, positive and negative cases, then the stateful /tokenize -> /v1/completions link, on a
LocalServer with a replica of its own (a request that kills an engine must not take the package's shared
one with it). Checks: no 5xx, status codes, content types and bodies as the schema says, and every error in
OpenAI's shape, a 400 naming its `param` (testing/fuzz_hooks.py's `openai_error_shape`; importing it also
registers its `before_call` hook, which caps max_tokens). The last test asserts what schemathesis' warnings
would: each body route had positive cases accepted, and no generation request was a 404 (the fuzzer reached
generation).
"""

import collections

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

from testing.fuzz_hooks import openai_error_shape

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          openai_error_shape]
FUZZ_SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                         phases=[Phase.explicit, Phase.generate], database=None)
STATUSES: collections.Counter = collections.Counter()  # (method path, generation mode, status) of every call


@pytest.fixture(scope="module")
def fuzz_schema(start_server):
    server = start_server(own_replica=True)
    return schemathesis.openapi.from_url(server.base_url + "/openapi.json")


def _validated(case, response, mode: str) -> None:
    STATUSES[f"{case.method} {case.path}", mode, response.status_code] += 1
    case.validate_response(response, checks=CHECKS)


def _fuzz_operation(operation, mode: GenerationMode) -> None:
    @FUZZ_SETTINGS
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        _validated(case, case.call(), mode.value)

    run()


# schemathesis' pytest loader (`from_fixture` + `parametrize`) sets a node attribute pytest 9 no longer has;
# the operations are fuzzed here one by one, through the same strategies.
@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda m: m.value)
def test_fuzz(fuzz_schema, mode):
    failures = []
    for result in fuzz_schema.get_all_operations():
        operation = result.ok()
        try:
            _fuzz_operation(operation, mode)
        except Unsatisfiable:  # no negative case for a route without parameters or body
            continue
        except Exception as exc:  # every operation runs; each one's minimal failure is reported
            failures.append(f"{operation.label}: {exc}")
    assert not failures, "\n\n".join(failures)


def test_fuzz_stateful(fuzz_schema):
    """/tokenize's ids into /v1/completions (the schema's link), and the other routes around them."""
    machine = fuzz_schema.as_state_machine()

    class Machine(machine):
        def validate_response(self, response, case, **kwargs):
            _validated(case, response, "stateful")

    Machine.run(settings=settings(max_examples=25, stateful_step_count=4, deadline=None, derandomize=True,
                                  suppress_health_check=list(HealthCheck), database=None))
    assert any(route == "POST /v1/completions" and mode == "stateful" and status == 200
               for route, mode, status in STATUSES), STATUSES


def test_fuzz_reached_generation():
    """Neither schemathesis warning: no body route mostly rejected, no generation route answered 404."""
    assert STATUSES, "run the fuzz tests first (this module, in order)"
    for route in {route for route, _, _ in STATUSES if route.startswith("POST")}:
        positive = {s: n for (r, mode, s), n in STATUSES.items() if r == route and mode == "positive"}
        accepted = sum(n for s, n in positive.items() if s < 300)
        assert accepted >= sum(positive.values()) / 2, (route, positive)
        assert 404 not in positive, (route, positive)
    by_status = collections.Counter()
    for (_, _, status), n in STATUSES.items():
        by_status[status] += n
    print(f"fuzz: {sum(by_status.values())} requests; by status {dict(sorted(by_status.items()))}")
