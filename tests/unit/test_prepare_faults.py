"""Fault drills of model preparation (issue 16): a converter killed mid-conversion, a cache that cannot be
written (read-only, full). No half-written model is ever returned; the next start completes it; a cache
that cannot be written is one clear ModelCacheError naming the directory.

A tiny llama GGUF (testing/tiny_gguf.py, SmolLM2's tokenizer) converts in about a second. Read-only and
full file systems are real tmpfs mounts: as root (CI containers) they are mounted here; without the
right to mount, the read-only case uses a directory without write permission and the full case skips.
"""

import contextlib
import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from model_files.architectures import check_model_dir
from model_files.prepare import (COMPLETE_MARKER, ModelCacheError, cache_write_failure, cached_dir,
                                     is_complete, prepare_model)

REPO_ROOT = Path(__file__).resolve().parents[2]

# Run in a child process: the converter SIGKILLs itself once the weights (the GGUF's link) are written, before the tokenizer
# files and the marker (a kill mid-conversion, at a point this test chooses rather than one a timer hits).
KILLED_CONVERTER = """
import os, signal, sys
import model_files.gguf as gguf

def killed(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

gguf.save_tokenizer = killed
from model_files.prepare import prepare_model
prepare_model(sys.argv[1], cache_dir=sys.argv[2], progress=False)
"""


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    from testing.tiny_gguf import write_tiny_gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_tiny_gguf(path, "llama", {})
    return path


@contextlib.contextmanager
def tmpfs(where: Path, options: str):
    """A tmpfs mounted at `where` for the block; skips the test where this process may not mount."""
    where.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_a_converter_killed_mid_conversion_leaves_no_model_and_the_next_start_completes_it(tiny_gguf, tmp_path):
    cache_dir = tmp_path / "cache"
    killed = subprocess.run([sys.executable, "-c", KILLED_CONVERTER, str(tiny_gguf), str(cache_dir)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    target = cached_dir(tiny_gguf.resolve(), cache_dir)
    assert not target.exists()  # nothing a loader could pick up
    [half] = target.parent.glob(f".{target.name}.tmp-*")  # the killed converter's, weights but no tokenizer
    assert (half / "model.gguf").is_symlink() and not (half / "tokenizer.json").exists()
    assert not (half / COMPLETE_MARKER).exists()

    assert prepare_model(str(tiny_gguf), cache_dir=cache_dir, progress=False) == target  # the next start
    assert is_complete(target) and (target / "tokenizer.json").is_file()
    check_model_dir(str(target))
    assert list(target.parent.glob(f".{target.name}.tmp-*")) == []  # the half-written one is gone


def test_a_directory_without_the_marker_is_converted_again_not_loaded(tiny_gguf, tmp_path):
    target = cached_dir(tiny_gguf.resolve(), tmp_path)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # half a model, as an older converter may have left it
    assert prepare_model(str(tiny_gguf), cache_dir=tmp_path, progress=False) == target
    assert is_complete(target) and (target / "model.gguf").resolve() == tiny_gguf.resolve()
    check_model_dir(str(target))


def test_a_read_only_cache_is_a_clear_error(tiny_gguf, tmp_path):
    where = tmp_path / "read-only"
    if os.geteuid() == 0:  # root writes through permission bits: a read-only file system instead
        context = tmpfs(where, "ro,size=1m")
    else:
        where.mkdir()
        where.chmod(0o555)
        context = contextlib.nullcontext(where)
    with context:
        with pytest.raises(ModelCacheError) as failed:
            prepare_model(str(tiny_gguf), cache_dir=where, progress=False)
    message = str(failed.value)
    assert message.startswith(f"cannot write the model cache {where}: ")
    assert ("read-only file system" in message or "permission denied" in message) and "TETHER_CACHE_DIR" in message


def test_a_full_cache_is_a_clear_error_and_leaves_nothing_behind(tiny_gguf, tmp_path):
    where = tmp_path / "full"
    with tmpfs(where, "size=1m"):  # the weights alone are ~50 MB
        with pytest.raises(ModelCacheError) as failed:
            prepare_model(str(tiny_gguf), cache_dir=where, progress=False)
        left = sorted(p.name for p in (where / "models").iterdir())
    assert str(failed.value).startswith(f"cannot write the model cache {where}: no space left (")
    assert left == [cached_dir(tiny_gguf.resolve(), where).name + ".lock"]  # no temporary, no target


def test_the_cli_says_why_and_exits_2(tiny_gguf, tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # a cache "directory" that is a file: nothing can be written under it
    result = subprocess.run([sys.executable, "-m", "model_files.prepare", str(tiny_gguf), "--cache-dir",
                             str(blocked), "--no-progress"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"error: cannot write the model cache {blocked}: ")


def test_an_error_reading_the_gguf_is_not_blamed_on_the_cache(tmp_path):
    cache = tmp_path / "cache"
    assert cache_write_failure(PermissionError(errno.EACCES, "Permission denied", "/models/x.gguf"), cache) is None
    assert cache_write_failure(PermissionError(errno.EACCES, "Permission denied", str(cache / "m")), cache) \
        == "permission denied"
    assert cache_write_failure(RuntimeError("Error while serializing: (os error 28)"), cache) == "no space left"
    assert cache_write_failure(ValueError("unknown tensor"), cache) is None


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
