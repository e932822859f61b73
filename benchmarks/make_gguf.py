"""The GGUF files llama.cpp's side of the decode benchmarks reads, written by llama.cpp's own converter:

    python benchmarks/make_gguf.py --llama-cpp <llama.cpp source tree> --out /tmp/gguf --shapes 135m 1.7b \
        --types f32 bf16 q8_0

For each shape (135m: SmolLM2-135M-Instruct, the real weights; 360m and 1.7b: the random-weight folders of
benchmarks/model_shapes.py, made if missing) and each of the converter's output types, this runs

    python <llama.cpp>/convert_hf_to_gguf.py <model folder> --outtype TYPE --outfile <out>/<shape>-<type>.gguf

with the tree's own ``gguf-py`` first on PYTHONPATH (the converter and its reader of the same version), and
prints the ``--gguf`` arguments benchmarks/decode_growth.py takes. A file already there is kept. The
converter imports ``sentencepiece`` for a Llama vocabulary (``pip install sentencepiece``). llama.cpp's source
comes with llama-cpp-python's sdist (``vendor/llama.cpp``), as benchmarks/serving_peers.py's docstring says.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from model_shapes import SHAPES, make_shape  # (benchmarks/ is on sys.path)

from minillm.formats.weights import resolve_model

DTYPES = {"f32": "float32", "bf16": "bfloat16"}  # converter types that minillm runs too (decode_growth's --dtypes)


def model_folder(shape: str) -> Path:
    """The Hugging Face folder of ``shape``: the real 135M model, or a random-weight shape."""
    return resolve_model("smollm2-135m-instruct", None, download=True) if shape == "135m" else make_shape(shape)


def convert(llama_cpp: Path, folder: Path, outtype: str, outfile: Path) -> None:
    """Run llama.cpp's converter on ``folder``; SystemExit with its last line of stderr when it fails."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(llama_cpp / "gguf-py"),
                                                                      os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(folder), "--outtype", outtype,
                          "--outfile", str(outfile)], capture_output=True, text=True, env=env)
    if run.returncode != 0:
        last = (run.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"convert_hf_to_gguf.py {folder.name} --outtype {outtype} failed: {last}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source tree (its converter)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the .gguf files")
    parser.add_argument("--shapes", nargs="+", default=["135m"], choices=["135m", *SHAPES])
    parser.add_argument("--types", nargs="+", default=["f32", "bf16"], choices=["f32", "bf16", "q8_0"],
                        help="the converter's --outtype values")
    args = parser.parse_args(argv)
    if not (args.llama_cpp / "convert_hf_to_gguf.py").is_file():
        parser.error(f"no convert_hf_to_gguf.py in {args.llama_cpp}; give llama.cpp's source tree "
                     "(vendor/llama.cpp in llama-cpp-python's sdist)")
    args.out.mkdir(parents=True, exist_ok=True)
    gguf_args = []
    for shape in args.shapes:
        folder = model_folder(shape)
        for outtype in args.types:
            outfile = args.out / f"{shape}-{outtype}.gguf"
            if not outfile.is_file():
                convert(args.llama_cpp, folder, outtype, outfile)
            print(f"{outfile} ({outfile.stat().st_size / 2**20:,.0f} MiB)", flush=True)
            if outtype in DTYPES:
                gguf_args.append(f"{shape}:{DTYPES[outtype]}={outfile}")
    if gguf_args:
        print("decode_growth.py --gguf " + " ".join(gguf_args))


if __name__ == "__main__":
    main()
