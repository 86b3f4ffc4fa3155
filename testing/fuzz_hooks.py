"""What every fuzz run of Tether's API registers with schemathesis (on import of this module):

- the check `openai_error_shape`: every 4xx/5xx is {"error": {message, type, param, code}}, and a 400 for a
  JSON object names its `param` (a body that is no JSON object has no field to blame);
- the `before_call` hook: max_tokens (max_completion_tokens, min_tokens) capped at MAX_TOKENS, since the
  engine runs on 2 cores; valid values only, so that a negative case stays negative.

The bounded run (tests/http/test_fuzz.py) and the long one (bench/reliability/fuzz.py) both import it.
"""

import schemathesis

MAX_TOKENS = 8


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
