"""llama.cpp's own GBNF grammars (``grammars/*.gbnf``), the test corpus for minillm's GBNF support.

Not copied into this repository: fetched once from PyPI, where the sdist of llama-cpp-python
(pinned below) vendors llama.cpp, and cached in ~/.cache/minillm-test/. The sdist is about 50 MB
and the download (pip prepares its metadata too) took 5-30 s here; only the .gbnf files are kept.

    grammars = llama_cpp_grammars()          # {"arithmetic.gbnf": "root ::= ...", ...}
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest
from filelock import FileLock

VERSION = "0.3.16"  # llama-cpp-python's sdist: vendor/llama.cpp/grammars/ has the 8 files of NAMES
NAMES = ("arithmetic.gbnf", "c.gbnf", "chess.gbnf", "english.gbnf", "japanese.gbnf", "json.gbnf", "json_arr.gbnf",
         "list.gbnf")
CACHE = Path.home() / ".cache" / "minillm-test" / f"llama-cpp-python-{VERSION}-grammars"
DOWNLOAD_TIMEOUT_S = 600


def llama_cpp_grammars() -> dict[str, str]:
    """{file name: GBNF text} of the pinned sdist's grammars; the test skips, with the reason, only
    when the download itself fails (no network, PyPI down)."""
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(CACHE) + ".lock"):
        if not CACHE.is_dir():
            _download_and_extract()
    return {path.name: path.read_text(encoding="utf-8") for path in sorted(CACHE.glob("*.gbnf"))}


def _download_and_extract() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            f"llama-cpp-python=={VERSION}", "-d", tmp, "--quiet"],
                           check=True, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
            last = (getattr(error, "stderr", None) or "").strip().splitlines()[-1:] or [str(error)]
            pytest.skip(f"cannot download llama-cpp-python=={VERSION}'s sdist from PyPI (the GBNF corpus): {last[0]}")
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        staging = Path(tmp) / "grammars"
        staging.mkdir()
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():  # read the files, never extract paths from the archive
                path = Path(member.name)
                if member.isfile() and path.suffix == ".gbnf" and path.parent.name == "grammars":
                    (staging / path.name).write_bytes(tar.extractfile(member).read())
        staging.rename(CACHE)
