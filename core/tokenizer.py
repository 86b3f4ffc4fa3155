"""Tokenizer loading, from a prepared checkpoint directory (never a hub)."""

from pathlib import Path


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def eos_token_ids(tokenizer, model_config, model_dir: str | Path | None = None) -> frozenset[int]:
    """Every id that ends a turn: the tokenizer's EOS, the model config's eos_token_id(s) and the generation
    config's (generation_config.json: where Gemma 3 lists <end_of_turn> and Llama 3.x <|eot_id|>, <|eom_id|>)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    configs = [model_config]
    if model_dir is not None and (Path(model_dir) / "generation_config.json").is_file():
        from transformers import GenerationConfig

        configs.append(GenerationConfig.from_pretrained(str(model_dir), local_files_only=True))
    for config in configs:
        config_eos = getattr(config, "eos_token_id", None)
        if isinstance(config_eos, int):
            ids.add(config_eos)
        elif config_eos:
            ids.update(config_eos)
    return frozenset(ids)
