"""prepare_model: directory specs, the conversion cache, concurrent preparers, errors.

The float32 conversion (the slow one, with a progress bar) runs once per module, by two CLI processes racing
into an empty cache; the reuse test then prepares the same GGUF in-process. The engine's own layout (the GGUF
linked, its blocks kept) is prepared beside it.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from model_files.prepare import COMPLETE_MARKER, default_gguf_path, prepare_model

REPO_ROOT = Path(__file__).resolve().parents[2]
PROGRESS_LABEL = "gguf -> safetensors"  # tqdm's desc in model_files/gguf.py


@pytest.fixture(scope="module")
def race(tmp_path_factory) -> tuple[Path, list[subprocess.CompletedProcess]]:
    """Two `python -m model_files.prepare` started together on one empty cache."""
    cache_dir = tmp_path_factory.mktemp("cache")
    cmd = [sys.executable, "-m", "model_files.prepare", "default", "--cache-dir", str(cache_dir), "--float32"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    procs = [
        subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        results.append(subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr))
    return cache_dir, results


def test_concurrent_prepares_share_one_directory(race):
    cache_dir, results = race
    for r in results:
        assert r.returncode == 0, r.stderr
    paths = {r.stdout.strip().splitlines()[-1] for r in results}
    assert len(paths) == 1
    model_dir = Path(paths.pop())
    assert model_dir.parent == cache_dir.resolve() / "models"
    assert [p for p in model_dir.parent.iterdir() if p.suffix != ".lock"] == [model_dir]
    assert (model_dir / COMPLETE_MARKER).is_file()
    # the loser of the lock found the winner's directory and converted nothing
    assert sum(PROGRESS_LABEL in r.stderr for r in results) == 1


def test_second_prepare_reuses_directory(race):
    cache_dir, results = race
    model_dir = Path(results[0].stdout.strip().splitlines()[-1])
    weights = model_dir / "model.safetensors"
    mtime_ns = weights.stat().st_mtime_ns
    assert prepare_model("default", cache_dir=cache_dir, progress=False, float32=True) == model_dir
    assert prepare_model(str(default_gguf_path()), cache_dir=cache_dir, progress=False, float32=True) == model_dir
    assert weights.stat().st_mtime_ns == mtime_ns


def test_the_engine_layout_links_the_gguf_and_holds_no_weights(tmp_path):
    model_dir = prepare_model("default", cache_dir=tmp_path, progress=False)
    assert (model_dir / "model.gguf").resolve() == default_gguf_path().resolve()
    assert not list(model_dir.glob("*.safetensors"))
    assert {"config.json", "tokenizer.json", COMPLETE_MARKER} <= {p.name for p in model_dir.iterdir()}
    assert model_dir != prepare_model("default", cache_dir=tmp_path, progress=False, float32=True)


def test_directory_spec_is_returned_resolved(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    spec = str(tmp_path / "ckpt" / ".." / "ckpt")
    assert prepare_model(spec, cache_dir=tmp_path / "unused") == (tmp_path / "ckpt").resolve()
    assert not (tmp_path / "unused").exists()


def test_missing_path_raises(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        prepare_model(str(tmp_path / "nope.gguf"), cache_dir=tmp_path)


def test_directory_without_config_raises(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        prepare_model(str(tmp_path), cache_dir=tmp_path)


def test_non_gguf_file_raises(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match="not a .gguf"):
        prepare_model(str(tmp_path / "weights.bin"), cache_dir=tmp_path)


def test_default_gguf_path_points_at_the_package_file():
    path = default_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 0


if __name__ == "__main__": import sys, pytest; sys.exit(pytest.main([__file__, "-q"]))
