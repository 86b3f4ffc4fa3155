"""The tokenizer of a converted GGUF: transformers' fast tokenizer built from the GGUF metadata, saved with the
file's chat template inline."""

import json
from pathlib import Path

from transformers import PreTrainedTokenizerFast

def save_tokenizer(gguf_path: Path, out_dir: Path, chat_template: str | None) -> None:
    """Build the fast tokenizer from the GGUF metadata and save it to `out_dir`.

    The generic class, not AutoTokenizer's pick: AutoTokenizer parses the whole GGUF once more (seconds,
    for 100k-token vocabularies) only to choose a class (Qwen2Tokenizer, ...) that wraps the same
    tokenizer.json; the generic one keeps exactly what transformers built from the GGUF."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(out_dir)
    patch_tokenizer_config(out_dir / "tokenizer_config.json", chat_template)


# Loader arguments that transformers echoes into tokenizer_config.json.
LOADER_KEYS = ("is_local", "local_files_only", "gguf_file")


def patch_tokenizer_config(path: Path, chat_template: str | None) -> None:
    """Keep the chat template inline in tokenizer_config.json; drop echoed loader arguments."""
    config = json.loads(path.read_text())
    for key in LOADER_KEYS:
        config.pop(key, None)
    if chat_template is not None:
        config["chat_template"] = chat_template
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
