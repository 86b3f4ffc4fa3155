"""The preparation drills of bench/reliability/drills.py (no Ray): the model cache unwritable, and `prepare`
killed mid-write.

  cache-unwritable  prepare into a read-only tmpfs, and into a full one (1 MB). Pass: exit 2 and one line
                    "error: cannot write the model cache <dir>: <why> ..." each; nothing left but the lock.
                    Mounting tmpfs needs root (a CI container); elsewhere it reports SKIP (None).
  prepare-killed    SIGKILL of `python -m model_files.prepare default` once its temporary directory
                    has the weights file. Pass: no model directory appears; the next run completes it (marker
                    present, the checkpoint loads).
Each returns (passed, or None for skipped; one line saying what happened).
"""

import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT


def mount_tmpfs(where: Path, options: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                          capture_output=True).returncode == 0


def prepare_cli(cache_dir: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "model_files.prepare", "default", "--cache-dir",
                             str(cache_dir), "--no-progress"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def drill_cache_unwritable() -> tuple[bool | None, str]:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, options in (("read-only", "ro,size=1m"), ("full", "size=1m")):
            where = Path(tmp) / label
            if not mount_tmpfs(where, options):
                return None, "cannot mount a tmpfs here (needs root)"
            try:
                start = time.monotonic()
                proc = prepare_cli(where)
                _, stderr = proc.communicate(timeout=120)
                seconds = time.monotonic() - start
                models = where / "models"
                left = sorted(p.name for p in models.iterdir()) if models.exists() else []
            finally:
                subprocess.run(["umount", str(where)], check=True)
            line = stderr.strip().splitlines()[-1] if stderr.strip() else ""
            ok = (proc.returncode == 2 and line.startswith(f"error: cannot write the model cache {where}: ")
                  and all(name.endswith(".lock") for name in left))
            results.append((ok, f"{label}: exit {proc.returncode} after {seconds:.1f} s, {line[:110]!r}"))
    return all(ok for ok, _ in results), "; ".join(text for _, text in results)


def drill_prepare_killed() -> tuple[bool, str]:
    from model_files.architectures import check_model_dir
    from model_files.prepare import cached_dir, default_gguf_path, is_complete

    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp)
        target = cached_dir(default_gguf_path().resolve(), cache)
        start = time.monotonic()
        proc = prepare_cli(cache)
        weights = None
        while proc.poll() is None and time.monotonic() - start < 120:
            weights = next(iter(target.parent.glob(f".{target.name}.tmp-*/model.safetensors")), None) \
                if target.parent.exists() else None
            if weights is not None:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed_at = time.monotonic() - start
        half_written = weights is not None and not target.exists()
        start = time.monotonic()
        rerun = prepare_cli(cache)
        stdout, stderr = rerun.communicate(timeout=300)
        seconds = time.monotonic() - start
        complete = rerun.returncode == 0 and stdout.strip().splitlines()[-1] == str(target) and is_complete(target)
        if complete:
            check_model_dir(str(target))
        leftovers = list(target.parent.glob(f".{target.name}.tmp-*"))
    ok = half_written and complete and not leftovers
    return ok, (f"killed {killed_at:.1f} s in, mid-write of the weights (no model directory: {half_written}); "
                f"the next run completed it in {seconds:.1f} s (marker, loads: {complete}); "
                f"temporaries left: {len(leftovers)}")
