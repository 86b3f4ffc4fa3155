"""Tokenizer loading, from a prepared checkpoint directory (never a hub)."""

from pathlib import Path


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def eos_token_ids(tokenizer, model_config) -> frozenset[int]:
    """Every id that ends a turn: the tokenizer's EOS and the model config's eos_token_id(s)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    config_eos = getattr(model_config, "eos_token_id", None)
    if isinstance(config_eos, int):
        ids.add(config_eos)
    elif config_eos:
        ids.update(config_eos)
    return frozenset(ids)
