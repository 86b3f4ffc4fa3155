"""Multi-turn chat: what each turn costs with retention on, retention off, and the prefix cache disabled.

    python -m bench.serve_path.multiturn [--turns 8] [--reply-tokens 32] [--reps 3] [--dtype auto]
    python -m bench.serve_path.multiturn --hybrid   # a random-weight Qwen3.5-text hybrid: state checkpoints on vs off
    python -m bench.serve_path.multiturn --images   # the hybrid with a vision tower, an image in turn 1

Three local servers (the production routes over one in-process replica each, no
Ray), one per mode, run one after another on the same 8-turn conversation
(user turns of ~60 tokens, greedy replies). Per turn: prompt tokens, cached
tokens (usage), tokens actually prefilled (the engine's own counter) and time
to first token (first SSE event, streamed through the openai client). Medians
over --reps conversations that differ in their first message.
"""

import argparse
import statistics
import time

import openai

from bench.common import user_turn
from core.app_config import AppConfig
from serve_app.local_server import LocalServer

HYBRID_MODES = {
    "checkpoints on": ({}, True),
    "checkpoints off": ({"enable_state_checkpoints": False}, True),
}
# A random-weight hybrid of SmolLM2's width (no hub: no real Qwen3.5 weights here); 3 linear layers per full one.
HYBRID_CONFIG = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=9,
                     num_key_value_heads=3, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
                     linear_key_head_dim=64, linear_value_head_dim=64,
                     layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
                     + ["full_attention"])
IMAGE_MODES = {"an image in turn 1": ({}, True)}
IMAGE_SIZE = (320, 240)  # pixels; the preprocessor (max 64 merged tokens) resizes it down
MODES = {  # name -> (engine overrides, per-request retain_token_ids)
    "retention on": ({}, True),
    "retention off": ({}, False),
    "no prefix cache": ({"enable_prefix_caching": False, "retain_token_ids": False}, False),
}


def image_turn(text: str, seed: int) -> dict:
    """A user message with one image (random pixels, one image per conversation: the model is random too)
    before the text."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (IMAGE_SIZE[1], IMAGE_SIZE[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                        {"type": "text", "text": text}]}


def one_turn(client, model: str, messages: list[dict], reply_tokens: int, retain: bool) -> tuple[str, dict, float]:
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=reply_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"retain_token_ids": retain, "chat_template_kwargs": {"enable_thinking": False}})
    ttft, text, usage = None, "", None
    for chunk in stream:
        ttft = ttft or time.perf_counter() - start
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage.to_dict()
    return text, usage, ttft


def run_mode(server: LocalServer, model: str, args, retain: bool) -> list[list[dict]]:
    """-> per rep, per turn: prompt, cached, prefilled, ttft."""
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    reps = []
    for rep in range(args.reps):
        messages, rows = [], []
        for k in range(args.turns):
            with_image = args.images and k == 0
            turn = user_turn(rep, k)
            messages.append(image_turn(turn, rep) if with_image else {"role": "user", "content": turn})
            before = server.replica.engine_stats()
            text, usage, ttft = one_turn(client, model, messages, args.reply_tokens, retain)
            after = server.replica.engine_stats()
            rows.append({"prompt": usage["prompt_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"],
                         "completion": usage["completion_tokens"], "ttft": ttft,
                         "prefilled": after["num_prompt_tokens_computed"] - before["num_prompt_tokens_computed"],
                         "vision": after["num_vision_runs"] - before["num_vision_runs"]})
            messages.append({"role": "assistant", "content": text})
        reps.append(rows)
    return reps


def new_tokens(rows: list[dict], k: int) -> int:
    """Prompt tokens turn k added after the previous turn's prompt + completion."""
    return rows[k]["prompt"] - (rows[k - 1]["prompt"] + rows[k - 1]["completion"] if k else 0)


def report(name: str, reps: list[list[dict]], turns: int, block_size: int) -> None:
    med = lambda key, k: statistics.median(r[k][key] for r in reps)  # noqa: E731
    within = all(r[k]["prefilled"] <= new_tokens(r, k) + block_size for r in reps for k in range(turns))
    print(f"\n{name}")
    print(f"{'turn':>4} {'prompt':>7} {'new':>5} {'cached':>7} {'prefilled':>9} {'ttft ms':>8} {'vision runs':>11}")
    for k in range(turns):
        print(f"{k + 1:>4} {med('prompt', k):>7.0f} {statistics.median(new_tokens(r, k) for r in reps):>5.0f} "
              f"{med('cached', k):>7.0f} {med('prefilled', k):>9.0f} {med('ttft', k) * 1000:>8.0f} "
              f"{med('vision', k):>11.0f}")
    print(f"ttft turn {turns} / turn 1: {med('ttft', turns - 1) / med('ttft', 0):.2f}x; "
          f"prefilled <= new + one block ({block_size}) on every turn of every conversation: {within}; "
          f"vision tower runs per conversation: {sorted({sum(row['vision'] for row in r) for r in reps})}")


def random_hybrid(tokenizer_model: str) -> str:
    """Builds (once, in the cache) a random-weight hybrid checkpoint with the given model's tokenizer."""
    from core.env import cache_dir
    from model_files.prepare import prepare_model
    from testing.tiny_hybrid import make_tiny_qwen3_5

    out = cache_dir() / "models" / "random-qwen3_5-text-576"
    return str(make_tiny_qwen3_5(out, prepare_model(tokenizer_model, progress=False), **HYBRID_CONFIG))


def random_vision_hybrid(tokenizer_model: str) -> str:
    """The --hybrid model's text part with a small vision tower and Qwen3.5's published chat template."""
    from core.env import cache_dir
    from model_files.prepare import prepare_model
    from testing.family_tokenizers import TEMPLATE_DIR
    from testing.tiny_vision import make_tiny_qwen3_5_vl

    text = {**HYBRID_CONFIG, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                 "partial_rotary_factor": 0.25, "mrope_section": [3, 3, 2],
                                                 "mrope_interleaved": True}}
    template = (TEMPLATE_DIR / "qwen3_5.jinja").read_text()
    out = cache_dir() / "models" / "random-qwen3_5-vl-576"
    return str(make_tiny_qwen3_5_vl(out, prepare_model(tokenizer_model, progress=False), text_overrides=text,
                                    chat_template=template))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--reply-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--hybrid", action="store_true", help="a random-weight Qwen3.5-text hybrid model")
    parser.add_argument("--images", action="store_true", help="the hybrid with a vision tower, an image in turn 1")
    args = parser.parse_args()
    if args.hybrid:
        args.model = random_hybrid(args.model)
    if args.images:
        args.model = random_vision_hybrid(args.model)
    modes = IMAGE_MODES if args.images else HYBRID_MODES if args.hybrid else MODES
    results = {}
    for name, (engine, retain) in modes.items():
        config = AppConfig(model=args.model, dtype=args.dtype, engine={"num_threads": 2, **engine})
        server = LocalServer(config)
        try:
            results[name] = run_mode(server, config.model_name(), args, retain)
        finally:
            server.stop()
    print(f"model {args.model}, dtype {args.dtype}, {args.turns} turns, {args.reply_tokens}-token greedy replies, "
          f"medians of {args.reps} conversations ('new': prompt tokens added after the previous prompt + reply)")
    for name, reps in results.items():
        report(name, reps, args.turns, config.engine.block_size)


if __name__ == "__main__":
    main()
