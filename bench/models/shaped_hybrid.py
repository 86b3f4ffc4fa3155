"""Random-weight Qwen3.5-shaped checkpoints for the hybrid benchmarks: safetensors for Tether (and vLLM), and
a GGUF for llama.cpp made by llama.cpp's own converter.

    python -m bench.models.shaped_hybrid [--shape qwen3_5-0.8b] [--gguf-type bf16]

The shapes (testing/shaped_hybrid.py): `qwen3_5-0.8b`, Qwen3.5-0.8B's text model; `qwen3_5-moe-small`,
Qwen3.5-35B-A3B's layout at the 0.8B's size. The checkpoint lands in <cache>/models/shaped-<shape> (bf16
safetensors, SmolLM2's tokenizer), the GGUF in <cache>/shaped/<shape>-<type>.gguf, written by
convert_hf_to_gguf.py of the llama.cpp that llama-cpp-python 0.3.36 vendors (its `qwen35` / `qwen35moe`
architectures), with its own gguf-py. Either that exists is kept. Prints both paths.
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

from core.env import cache_dir
from model_files.prepare import prepare_model
from testing.shaped_hybrid import SHAPES, make_shaped_hybrid


def checkpoint(shape: str) -> Path:
    return make_shaped_hybrid(cache_dir() / "models" / f"shaped-{shape}", prepare_model("default", progress=False),
                              shape)


def gguf(shape: str, out_type: str = "bf16") -> Path:
    """The checkpoint converted by llama.cpp's convert_hf_to_gguf.py (made once)."""
    from bench.peers.llama_server import install_llama_server

    path = cache_dir() / "shaped" / f"{shape}-{out_type}.gguf"
    if path.is_file():
        return path
    workdir = Path(os.environ.get("TETHER_PEERS_DIR", cache_dir() / "peers")) / "llama-server"
    install_llama_server(workdir, allowed=True)  # unpacks the vendored llama.cpp source
    source = next((workdir / "src").glob("llama_cpp_python-*/vendor/llama.cpp"))
    path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{source}:{source / 'gguf-py'}", "HF_HUB_OFFLINE": "1"}
    args = [str(checkpoint(shape)), "--no-mtp", "--outtype", out_type, "--outfile", str(path)]  # random: no MTP
    subprocess.run([sys.executable, "-c", CONVERT, str(source / "convert_hf_to_gguf.py"), *args], env=env, check=True)
    return path


# The converter names the tokenizer's pre-tokenizer by hashing what AutoTokenizer makes of a test string. For a
# qwen3_5_moe checkpoint transformers builds its Qwen3_5Tokenizer over SmolLM2's vocabulary whatever
# tokenizer_config says, and the hash matches nothing: the tokenizer here is SmolLM2's, so it is named so.
CONVERT = """
import runpy, sys
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3_5-0.8b", choices=sorted(SHAPES))
    parser.add_argument("--gguf-type", default="bf16", help="convert_hf_to_gguf.py's --outtype; 'none': skip")
    args = parser.parse_args()
    print(checkpoint(args.shape))
    if args.gguf_type != "none":
        print(gguf(args.shape, args.gguf_type))


if __name__ == "__main__":
    main()
