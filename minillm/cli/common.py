"""What every command shares: the one-line usage error, the parser, model options, output checks."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .. import weights
from ..errors import OutputPathError, check_output_dir


class UsageError(Exception):
    """Bad command-line usage: one line on stderr, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print the whole usage block; one line is kinder
        raise UsageError(f"{message} (see '{self.prog} --help')")


def model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=weights.DEFAULT_MODEL,
                   help=f"model name, hub repo id, folder or .gguf file (default: {weights.DEFAULT_MODEL})")
    p.add_argument("--weights-dir", help="where models are stored (default: $MINILLM_WEIGHTS, ./weights, ~/.cache/minillm)")
    p.add_argument("--device", help="cpu, cuda or mps (default: cuda if available)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default float32 (bfloat16 on cuda)")
    p.add_argument("--debug", action="store_true", help="show full tracebacks on errors")


def ensure_model(name_or_path: str, weights_dir: str | None):
    """The model folder; a missing known model is downloaded first, with a notice."""
    if weights.is_model_name(name_or_path) and not weights.is_downloaded(name_or_path, weights_dir):
        print(f"minillm: {name_or_path} is not downloaded yet; fetching it into "
              f"{weights.weights_dir(weights_dir)} (once)", file=sys.stderr)
    return weights.resolve_model(name_or_path, weights_dir, download=True)


def check_out_file(flag: str, path: str, suffix: str | None = None) -> None:
    """A usage error now for an output file that could not be written after the work."""
    target = Path(path).expanduser().absolute()
    if suffix and target.suffix.lower() != suffix:
        raise UsageError(f"{flag}: {path} must end in {suffix}")
    if target.is_dir():
        raise UsageError(f"{flag}: {target} is a folder; give a file name")
    if not target.parent.is_dir():
        raise UsageError(f"{flag}: folder {target.parent} does not exist; create it or pick another path")


def check_out_dir(flag: str, path: str) -> None:
    """A usage error now when the output folder ``path`` could not be written at the end."""
    try:
        check_output_dir(path)
    except OutputPathError as e:
        raise UsageError(f"{flag}: {e}") from None


def write_text(path, text: str):
    Path(path).write_text(text)
    return path
