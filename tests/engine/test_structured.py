"""Structured outputs through the real engine on the tiny random Llama (SmolLM2's tokenizer): every kind holds,
the mask is seen by logprobs and touches no other row, start_after, min_tokens / max_tokens / stop strings
with a grammar, preemption, the matcher rebuilt from the ids, invalid specs refused, a grammar failing
mid-generation, and nothing left behind."""

import asyncio
import json
import re
import time

import jsonschema
import pytest
import torch
import xgrammar as xgr

from core.messages import GenerateRequest, RequestError, SamplingParams, StructuredSpec
from replicas.engine.async_engine import AsyncEngine
from replicas.sampling.grammar import GrammarState
from tests.engine.conftest import greedy, prompts, run_all

PROMPT = prompts([12])[0]
# Small on purpose: enums, booleans and short strings, so a random model finishes.
SCHEMA = {"type": "object",
          "properties": {"kind": {"enum": ["cat", "dog", "emu"]}, "ok": {"type": "boolean"},
                         "tag": {"type": "string", "maxLength": 3},
                         "sizes": {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 2}},
          "required": ["kind", "ok", "tag", "sizes"], "additionalProperties": False}


def spec(kind: str, text: str = "", **kwargs) -> StructuredSpec:
    return StructuredSpec(kind, text, **kwargs)


def constrained(rid: str, structured: StructuredSpec, max_tokens: int = 64, prompt=PROMPT, **kwargs):
    return GenerateRequest(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                       structured=structured, **kwargs))


def run_deltas(engine, requests):
    out = {r.request_id: [] for r in requests}
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished():
        for delta in engine.step():
            out[delta.request_id].append(delta)
    return out


def text_of(deltas) -> str:
    return "".join(d.text for d in deltas)


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine()


@pytest.fixture(scope="module")
def free_run(engine) -> list[int]:
    return run_all(engine, [greedy("free", PROMPT, 24)])["free"]


def test_json_schema_holds_and_ends_with_stop(engine):
    deltas = run_deltas(engine, [constrained("j", spec("json_schema", json.dumps(SCHEMA)))])["j"]
    assert deltas[-1].finish_reason == "stop"
    jsonschema.validate(json.loads(text_of(deltas)), SCHEMA)
    assert engine.grammars.num_live == 0


def test_json_object_regex_choice_and_ebnf_hold(engine):
    requests = [constrained("obj", spec("json_object")),
                constrained("re", spec("regex", r"[0-9]{3}-[a-z]{2}")),
                constrained("ch", spec("choice", choices=["left", "right", 'say "hi"\n'])),
                constrained("g", spec("grammar", 'root ::= "(" [xy]+ ")" | "none"'))]
    deltas = run_deltas(engine, requests)
    assert all(d[-1].finish_reason == "stop" for d in deltas.values())
    out = {rid: text_of(d) for rid, d in deltas.items()}
    assert isinstance(json.loads(out["obj"]), dict)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", out["re"])
    assert out["ch"] in ("left", "right", 'say "hi"\n')
    assert re.fullmatch(r"\([xy]+\)|none", out["g"])


def test_structural_tag_for_a_tool_call(engine):
    """What tool_choice "required" / named builds: a tag whose content is the call's JSON (whitespace bounded,
    else a small model may loop on it)."""
    call = {"type": "object", "properties": {"name": {"const": "get_weather"},
                                             "arguments": {"type": "object",
                                                           "properties": {"unit": {"enum": ["c", "f"]}},
                                                           "required": ["unit"]}},
            "required": ["name", "arguments"]}
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<tool_call>\n",
                                                "content": {"type": "json_schema", "json_schema": call,
                                                            "max_whitespace_cnt": 1},
                                                "end": "\n</tool_call>"}}
    deltas = run_deltas(engine, [constrained("t", spec("structural_tag", json.dumps(tag)))])["t"]
    text = text_of(deltas)
    assert deltas[-1].finish_reason == "stop", text
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
    jsonschema.validate(json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")), call)


def test_logprobs_see_the_mask(engine):
    deltas = run_deltas(engine, [constrained("lp", spec("regex", "[0-9]{6}"), logprobs=20)])["lp"]
    entries = [e for d in deltas for e in d.logprobs]
    assert entries and re.fullmatch("[0-9]{6}", text_of(deltas))
    for entry in entries:  # every alternative listed is one the grammar allows: digits only
        assert all(re.fullmatch("[0-9]+", text) for _, text, _ in entry.top), entry.top
        # The probability mass is over the allowed tokens only: the alternatives carry most of it.
        assert sum(torch.tensor([lp for *_, lp in entry.top]).exp()) > 0.5


def test_mask_touches_only_its_own_rows(engine, free_run):
    alone = run_all(engine, [constrained("c", spec("json_schema", json.dumps(SCHEMA)))])["c"]
    mixed = run_all(engine, [greedy("free", PROMPT, 24), constrained("c", spec("json_schema", json.dumps(SCHEMA)))])
    assert mixed == {"free": free_run, "c": alone}


def test_start_after_frees_the_tokens_up_to_the_marker(engine, free_run):
    marker = free_run[3:5]
    start = next(i for i in range(len(free_run)) if free_run[i:i + 2] == marker) + 2  # first time it appears
    deltas = run_deltas(engine, [constrained("s", spec("regex", "[0-9]{4}", start_after=marker))])["s"]
    ids = [t for d in deltas for t in d.token_ids]
    assert ids[:start] == free_run[:start]  # unconstrained up to and including the marker
    assert re.fullmatch("[0-9]{4}", engine.tokenizer.decode(ids[start:-1])) and deltas[-1].finish_reason == "stop"
    # absent: from the first token
    first = text_of(run_deltas(engine, [constrained("n", spec("regex", "[0-9]{4}", start_after=None))])["n"])
    assert re.fullmatch("[0-9]{4}", first)


def test_min_tokens_with_a_grammar_the_grammar_end_wins(engine):
    # The grammar is complete after one word; min_tokens bans the only token left (EOS): the grammar's end wins.
    deltas = run_deltas(engine, [constrained("m", spec("choice", choices=["yes"]), min_tokens=8)])["m"]
    assert text_of(deltas) == "yes" and deltas[-1].finish_reason == "stop"
    # Where the grammar may go on, min_tokens holds the end back: at least 8 tokens of the grammar's.
    deltas = run_deltas(engine, [constrained("a", spec("regex", "a+"), min_tokens=8, max_tokens=12)])["a"]
    ids = [t for d in deltas for t in d.token_ids]
    text = text_of(deltas)
    assert re.fullmatch("a+", text) and len([t for t in ids if t not in engine.eos_token_ids]) >= 8


def test_max_tokens_cuts_json_short(engine):
    deltas = run_deltas(engine, [constrained("cut", spec("json_schema", json.dumps(SCHEMA)), max_tokens=3)])["cut"]
    full = text_of(run_deltas(engine, [constrained("full", spec("json_schema", json.dumps(SCHEMA)))])["full"])
    assert deltas[-1].finish_reason == "length" and sum(len(d.token_ids) for d in deltas) == 3
    assert full.startswith(text_of(deltas)) and text_of(deltas) != full


def test_a_stop_string_inside_json_applies(engine):
    full = text_of(run_deltas(engine, [constrained("full", spec("json_schema", json.dumps(SCHEMA)))])["full"])
    deltas = run_deltas(engine, [constrained("st", spec("json_schema", json.dumps(SCHEMA)), stop=['"ok"'])])["st"]
    assert deltas[-1].finish_reason == "stop" and text_of(deltas) == full[:full.index('"ok"')]


def test_ignore_eos_still_ends_at_the_grammar_end(engine):
    deltas = run_deltas(engine, [constrained("i", spec("choice", choices=["no"]), ignore_eos=True)])["i"]
    assert text_of(deltas) == "no" and deltas[-1].finish_reason == "stop"


def test_n_sampled_choices_each_hold(engine):
    requests = [GenerateRequest(f"s{i}", PROMPT, SamplingParams(temperature=1.0, seed=i, max_tokens=64,
                                                                structured=spec("json_schema", json.dumps(SCHEMA))))
                for i in range(3)]
    compiled = engine.grammars.compile(requests[0].sampling.structured)
    for deltas in run_deltas(engine, requests).values():
        text = text_of(deltas)
        assert xgr.GrammarMatcher(compiled).accept_string(text), text  # held token by token, cut or not
        if deltas[-1].finish_reason == "stop":
            jsonschema.validate(json.loads(text), SCHEMA)


def test_preemption_keeps_the_matchers(make_engine):
    lengths = [3, 17, 40, 64, 5, 33, 90, 12]
    kinds = [spec("json_schema", json.dumps(SCHEMA)), spec("regex", "[0-9]{20}"), None]

    def requests():
        return [GenerateRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=24, structured=kinds[i % 3]))
                for i, p in enumerate(prompts(lengths))]

    roomy = run_all(make_engine(), requests())
    tight = make_engine(num_kv_blocks=40, block_size=4, max_num_seqs=8)
    assert run_all(tight, requests()) == roomy
    assert tight.scheduler.num_preemptions > 0 and tight.grammars.num_live == 0


def test_the_matcher_is_rebuilt_from_the_output_ids(engine):
    compiled = engine.grammars.compile(spec("regex", "[0-9]{3}x"))
    prompt = [5, 6]
    ids = [t for digits in ("12", "3") for t in engine.tokenizer.encode(digits, add_special_tokens=False)]
    state = GrammarState(compiled, None)
    assert state.advance(prompt + ids, len(prompt)) and state.num_seen == len(ids)
    # Tokens taken back (fewer output ids than seen): the state replays the ids it has, and goes on from there.
    assert state.advance(prompt + ids[:1], len(prompt)) and state.num_seen == 1
    assert state.advance(prompt + ids, len(prompt)) and not state.matcher.is_completed()
    assert state.matcher.accept_string("x") and state.matcher.is_completed()
    # The marker is found again when replaying, too.
    marker = [100, 101]
    gated = GrammarState(compiled, marker)
    assert gated.advance(prompt + marker + ids, len(prompt)) and gated.is_active
    assert gated.advance(prompt + marker[:1], len(prompt)) and not gated.is_active


@pytest.mark.parametrize("kind, text, param", [
    ("json_schema", json.dumps({"type": "objectx"}), "response_format"),
    ("regex", "(", "structured_outputs"),
    ("grammar", "root ::= ", "structured_outputs"),
    ("structural_tag", json.dumps({"type": "structural_tag", "format": {"type": "nope"}}), "structured_outputs"),
], ids=["schema", "regex", "ebnf", "structural_tag"])
def test_an_invalid_spec_is_refused_naming_its_field(engine, kind, text, param):
    with pytest.raises(RequestError) as err:
        engine.add_request(constrained("bad", spec(kind, text, param=param)))
    assert err.value.status_code == 400 and err.value.param == param and err.value.message.startswith(param)
    assert "/project/" not in err.value.message  # xgrammar's C++ log prefix is dropped
    assert not engine.has_unfinished() and engine.grammars.num_live == 0


def test_a_grammar_failing_mid_generation_fails_that_request_only(engine, free_run, monkeypatch):
    monkeypatch.setattr(GrammarState, "advance", lambda self, token_ids, num_prompt: False)
    out = run_deltas(engine, [greedy("free", PROMPT, 24), constrained("f", spec("regex", "[0-9]{4}"))])
    assert out["f"] == [] and [t for d in out["free"] for t in d.token_ids] == free_run
    [(rid, error)] = engine.take_failures()
    assert rid == "f" and error.status_code == 500 and "grammar" in error.message
    assert engine.grammars.num_live == 0 and engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


def test_a_batch_without_grammars_never_reaches_the_stage(engine, monkeypatch):
    def fail(*args):
        raise AssertionError("the grammar stage ran for a batch without grammars")

    monkeypatch.setattr(engine.grammars, "apply", fail)
    assert len(run_all(engine, [greedy("plain", PROMPT, 4)])["plain"]) == 4


def test_abort_releases_the_matcher(engine):
    engine.add_request(constrained("ab", spec("regex", "[0-9]{30}")))
    engine.step()
    assert engine.grammars.num_live == 1
    engine.abort_request("ab")
    assert engine.grammars.num_live == 0 and not engine.has_unfinished()


def test_padded_vocabulary_ids_are_masked(tiny_llama_dir, smollm2_dir, tmp_path_factory):
    """The logits are wider than the tokenizer (vocab_size padded): ids past it are never allowed."""
    from core.engine_config import EngineConfig
    from replicas.engine.engine import Engine
    from testing.tiny_models import TINY_LLAMA, HEAD_SCALE
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-padded")
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir), local_files_only=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer) + 64, bos_token_id=tokenizer.bos_token_id,
                                         eos_token_id=tokenizer.eos_token_id, **TINY_LLAMA)).float()
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    engine = Engine(EngineConfig(model=str(out), dtype="float32"))
    padded = len(tokenizer) + 10
    bias = {padded: 100.0}
    free = run_all(engine, [greedy("p", PROMPT, 3, logit_bias=bias)])["p"]
    assert free == [padded] * 3  # the bias wins without a grammar
    deltas = run_deltas(engine, [constrained("c", spec("regex", "[a-z]{5}"), logit_bias=bias)])["c"]
    assert re.fullmatch("[a-z]{5}", text_of(deltas)) and deltas[-1].finish_reason == "stop"


def test_async_engine_compiles_off_the_step_thread(tiny_llama_dir):
    from core.engine_config import EngineConfig
    from replicas.engine.engine import Engine

    engine = AsyncEngine(lambda: Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32")))

    async def collect(request):
        return [d async for d in engine.generate(request)]

    async def main():
        good = constrained("good", spec("json_schema", json.dumps(SCHEMA)))
        bad = constrained("bad", spec("json_schema", '{"type": "objectx"}'))
        return await asyncio.gather(collect(good), collect(bad), return_exceptions=True)

    blocker = spec("regex", "[a-z]{7}")

    async def cancelled_while_queued():
        # The first caller goes away while its grammar waits for the (one, busy) compile thread; the
        # compilation it would have shared must not be cancelled: the next request with the spec uses it.
        engine.engine.grammars.submit(blocker)
        target = spec("regex", "[0-9]{5}")
        first = asyncio.ensure_future(collect(constrained("gone", target)))
        await asyncio.sleep(0.1)
        first.cancel()
        second = await collect(constrained("next", target))
        return first, second

    compile_once = engine.engine.grammars._compile

    def slow_compile(s):
        if s.text == blocker.text:
            time.sleep(0.5)
        return compile_once(s)

    try:
        good, bad = asyncio.run(main())
        assert isinstance(bad, RequestError) and bad.param == "response_format"
        assert good[-1].finish_reason == "stop"
        jsonschema.validate(json.loads(text_of(good)), SCHEMA)
        engine.engine.grammars._compile = slow_compile
        first, second = asyncio.run(cancelled_while_queued())
        assert first.cancelled() and re.fullmatch("[0-9]{5}", text_of(second))
    finally:
        engine.shutdown()


def big_schema(num_properties: int) -> dict:
    """Slow to compile on SmolLM2's vocabulary (300 properties: ~250 ms on a 2-core EPYC)."""
    props = {f"p{i}": {"type": "object", "required": ["code", "tags"], "additionalProperties": False,
                       "properties": {"code": {"type": "string", "pattern": f"^[A-Z]{{2}}-[0-9]{{{2 + i % 5}}}$"},
                                      "tags": {"type": "array", "items": {"enum": [f"t{i}_{j}" for j in range(6)]}}}}
             for i in range(num_properties)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def test_steps_leave_a_core_to_each_compilation(make_engine):
    """While a grammar compiles on the pool, a step runs one thread fewer (a full OpenMP team beside a compile
    thread waits at its barriers); once it is compiled, steps take all their threads again."""
    threads_before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = make_engine()
        assert engine.num_threads == 2
        engine.add_request(greedy("running", PROMPT, 1000))
        compiling = engine.grammars.submit(spec("json_schema", json.dumps(big_schema(300))))
        seen_during = set()
        while not compiling.done():
            engine.step()
            seen_during.add(torch.get_num_threads())
        compiling.result()
        assert engine.grammars.num_compiling == 0
        engine.step()
        assert 1 in seen_during and torch.get_num_threads() == 2, seen_during
        engine.abort_request("running")
    finally:
        torch.set_num_threads(threads_before)


def test_async_stream_ends_with_the_error_after_its_deltas(tiny_llama_dir, monkeypatch):
    from core.engine_config import EngineConfig
    from replicas.engine.engine import Engine

    advance = GrammarState.advance
    monkeypatch.setattr(GrammarState, "advance",  # refuses the third generated token
                        lambda self, ids, num_prompt: len(ids) - num_prompt < 3 and advance(self, ids, num_prompt))
    engine = AsyncEngine(lambda: Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32")))
    got = []

    async def main():
        async for delta in engine.generate(constrained("f", spec("regex", "[0-9]{9}"))):
            got.append(delta)

    try:
        with pytest.raises(RequestError) as err:
            asyncio.run(main())
        assert err.value.status_code == 500 and sum(len(d.token_ids) for d in got) == 2
        assert engine.is_healthy and engine.engine.grammars.num_live == 0
    finally:
        engine.shutdown()


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
