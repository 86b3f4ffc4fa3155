"""Random-weight GGUFs with the shapes of real models, quantized by llama.cpp's own `llama-quantize`.

    python -m bench.models.shaped_gguf --shape llama-1b --types Q4_K_M Q8_0 [--out DIR] [--keep-f16]

A model a user downloads is llama.cpp's mixture of block types, not one type everywhere: Q4_K_M keeps most
matrices Q4_K and some V / down projections and the head Q6_K; Q5_K_M likewise with Q5_K. So each file here is
written once as F16 by testing/shaped_gguf.py (the shapes and vocabulary are described there), tensor by tensor
(an 8B's 16 GB never in memory), then quantized to each type by llama-quantize, built from the source
llama-cpp-python vendors (bench/peers/llama_server.py, into <cache>/peers/llama-server). Files land in <cache>/shaped/<shape>-<type>.gguf; one that exists is
kept. Prints each file's path and size.
"""

import argparse
import os
import subprocess
import time
from pathlib import Path

from core.env import cache_dir
from testing.shaped_gguf import SHAPES, write_gguf

TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0", "Q5_0", "Q5_1", "Q4_1")


def llama_quantize() -> Path:
    from bench.peers.llama_server import binary, install_llama_server

    workdir = Path(os.environ.get("TETHER_PEERS_DIR", cache_dir() / "peers")) / "llama-server"
    install_llama_server(workdir, allowed=True)
    return binary(workdir, "llama-quantize")


def make(shape: str, types: list[str], out: Path | None = None, keep_f16: bool = False) -> dict[str, Path]:
    """-> type -> the file (made unless it exists)."""
    out = Path(out or cache_dir() / "shaped")
    out.mkdir(parents=True, exist_ok=True)
    files = {t: out / f"{shape}-{t}.gguf" for t in types}
    todo = [t for t, p in files.items() if not p.is_file()]
    if not todo:
        return files
    f16 = out / f"{shape}-F16.gguf"
    if not f16.is_file():
        start = time.perf_counter()
        write_gguf(f16.with_suffix(".tmp"), shape)
        f16.with_suffix(".tmp").rename(f16)
        print(f"wrote {f16} in {time.perf_counter() - start:.0f} s", flush=True)
    tool = llama_quantize()
    for t in todo:
        start = time.perf_counter()
        tmp = files[t].with_suffix(".tmp")
        subprocess.run([str(tool), str(f16), str(tmp), t, str(os.cpu_count())], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        tmp.rename(files[t])
        print(f"quantized {files[t]} in {time.perf_counter() - start:.0f} s", flush=True)
    if not keep_f16:
        f16.unlink()
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    parser.add_argument("--types", nargs="+", default=["Q4_K_M"], choices=TYPES)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--keep-f16", action="store_true")
    args = parser.parse_args()
    for t, path in make(args.shape, args.types, args.out, args.keep_f16).items():
        print(f"{t}\t{path}\t{path.stat().st_size / 1e9:.3f} GB")


if __name__ == "__main__":
    main()
