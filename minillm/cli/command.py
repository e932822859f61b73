"""``minillm``'s parser and ``main``: every command's options (one module per command group adds its
own), and every error turned into one line and an exit code (cli/__init__.py lists the commands)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import warnings
from pathlib import Path

from .. import __version__, cpu_policy
from ..errors import MiniLLMError
from .bench import add_bench
from .bench_serving import add_bench_serving
from .chat import add_chat
from .check import add_check
from .common import Parser, UsageError
from .generate import add_generate
from .models import add_convert, add_download, add_info
from .prefix_demo import add_prefix_demo
from .roofline import add_calibrate, add_whatif
from .serve import add_serve
from .sweep import add_sweep


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``minillm`` console script; returns the exit code.

    Every error ends in one line on stderr: usage errors exit 2, the errors minillm raises for
    bad input exit 1, and anything else (a bug, an unexpected library error) exits 1 with its
    type and a pointer to --debug, which shows the full traceback instead.
    """
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    warnings.showwarning = _show_warning
    try:
        args = build_parser().parse_args(argv)
        args.argv = argv  # what a command that starts copies of itself (--tensor-parallel-size) passes on
        return args.run(args) or 0
    except UsageError as e:
        print(f"minillm: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`| head`): not an error of ours
        return _quiet_exit_on_closed_stdout()
    except KeyboardInterrupt:
        fresh_line = "\n" if sys.stderr.isatty() else ""  # a terminal echoed ^C, maybe mid-line of output
        print(f"{fresh_line}minillm: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if debug:
            raise
        print(f"minillm: error: {_one_line(e)}", file=sys.stderr)
        return 1


_PACKAGE = Path(__file__).resolve().parent.parent


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """minillm's own warnings as one line, like its errors; other libraries' as Python prints them."""
    if Path(filename).resolve().is_relative_to(_PACKAGE):
        print(f"minillm: warning: {message}", file=sys.stderr)
    else:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def _one_line(error: Exception) -> str:
    """The error as one line; an exception minillm did not expect also names its type and --debug."""
    text = " ".join(str(error).split()) or "(no message)"
    if isinstance(error, (MiniLLMError, ValueError, OSError)):  # raised for the user, worded for them
        return text
    return f"{type(error).__name__}: {text} (run with --debug for the traceback)"


def _quiet_exit_on_closed_stdout() -> int:
    """Exit status 141 (128 + SIGPIPE), as a C tool killed by SIGPIPE in `cmd | head` ends, silently.

    The recipe of Python's signal docs ("Note on SIGPIPE"): point stdout at devnull, so that
    the interpreter's final flush of the unwritten output does not raise again at exit.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout without a file descriptor (captured in tests)
        pass
    return 128 + signal.SIGPIPE


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="minillm", description="An educational LLM inference engine in pure PyTorch.",
                    epilog=cpu_policy.describe())
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    parser.add_argument("--version", action="version", version=f"minillm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    add_generate(sub)
    add_chat(sub)
    add_download(sub)
    add_convert(sub)
    add_info(sub)
    add_sweep(sub)
    add_calibrate(sub)
    add_whatif(sub)
    add_prefix_demo(sub)
    add_bench(sub)
    add_bench_serving(sub)
    add_check(sub)
    add_serve(sub)
    return parser
