"""Tether's greedy tokens on a GGUF against llama.cpp's own (`llama-server`) on the same file and prompt ids.

    python -m bench.models.llama_cpp_agreement FILE.gguf [FILE.gguf ...] [--tokens 32]

Each file is served by llama-server (bench/peers/llama_server.py: built from the llama.cpp llama-cpp-python
vendors; greedy, top-2 probabilities) and loaded by Tether's engine in-process (its blocks kept, float32, batch
invariant). Both continue the same prompt ids for --tokens tokens, end of text ignored. Prints, per file, how
many tokens agree before the first difference, and there each side's logprob gap between the two tokens
(how close the call was). llama.cpp quantizes its activations to 8 bits for its dot products; Tether keeps them
in float32, so the two differ by that rounding.
"""

import argparse
import json
import os
import urllib.request
from pathlib import Path

from core.env import cache_dir

PROMPT = [504, 3458, 282, 4649, 314, 7042, 30, 378, 1345, 1040, 282, 260, 3135, 1177, 314, 253, 5253, 28,
          1691, 314, 3180, 2372, 30, 378, 2193, 5180, 5326, 282, 8303, 1133, 29, 216, 1262, 2565, 314, 260]


def llama_cpp_greedy(model: Path, tokens: int) -> list[dict]:
    from bench.peers.llama_server import start_llama_server

    server = start_llama_server(Path(os.environ.get("TETHER_PEERS_DIR", cache_dir() / "peers")) / "llama-server",
                                model)
    try:
        body = dict(prompt=PROMPT, n_predict=tokens, temperature=0.0, top_k=1, n_probs=2, ignore_eos=True,
                    cache_prompt=False, post_sampling_probs=False)
        request = urllib.request.Request(server.base_url + "/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            out = json.loads(response.read())
        return [dict(id=step["id"], top={t["id"]: t["logprob"] for t in step["top_logprobs"]})
                for step in out["completion_probabilities"]]
    finally:
        server.stop()


def tether_greedy(model: Path, tokens: int) -> list[dict]:
    from core.engine_config import EngineConfig
    from core.messages import GenerateRequest, SamplingParams
    from model_files.prepare import prepare_model
    from replicas.engine.engine import Engine

    engine = Engine(EngineConfig(model=str(prepare_model(str(model), progress=False)), dtype="float32",
                                 num_kv_blocks=64, compile_step=False))
    engine.add_request(GenerateRequest("a", PROMPT, SamplingParams(temperature=0.0, max_tokens=tokens,
                                                                   ignore_eos=True, logprobs=2)))
    steps = []
    while engine.has_unfinished():
        for delta in engine.step():
            for token, entry in zip(delta.token_ids, delta.logprobs or []):
                steps.append(dict(id=token, top={tid: lp for tid, _, lp in entry.top}))
    return steps


def compare(model: Path, tokens: int) -> str:
    theirs, ours = llama_cpp_greedy(model, tokens), tether_greedy(model, tokens)
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a["id"] != b["id"]), min(len(ours), len(theirs)))
    line = f"{model.name}: {same} of {tokens} tokens equal"
    if same < min(len(ours), len(theirs)):
        a, b = ours[same], theirs[same]
        gap = lambda step, other: step["top"][step["id"]] - step["top"].get(other, float("nan"))  # noqa: E731
        line += (f"; at token {same} Tether {a['id']} (its gap to {b['id']}: {gap(a, b['id']):.4f} nats), "
                 f"llama.cpp {b['id']} (its gap to {a['id']}: {gap(b, a['id']):.4f} nats)")
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    for path in args.files:
        print(compare(path, args.tokens), flush=True)


if __name__ == "__main__":
    main()
