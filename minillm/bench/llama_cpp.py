"""The optional llama.cpp engine: llama-cpp-python on the same weights, written as an F32 GGUF.

llama.cpp is the peer a user knows for CPU inference; issue 16 sets minillm's batch-1 float32
decode at >= 0.9x llama.cpp's F32 on the same machine. For a fair comparison it runs exactly
minillm's float32 weights (:func:`minillm.formats.gguf_export.write_f32_gguf`, written once into
``<weights_dir>/_llama_cpp/``) and a float32 KV cache, greedy, batch 1, with torch's thread count.

    ttft(ids)              reset, eval(prompt), argmax of the last logits
    prepare_decode(ids)    reset, eval(first L-1 tokens)                    (untimed)
    decode(ids, n)         drop the KV cache past L-1 (llama.cpp's eval does), then
                           eval(last prompt token), eval(each new token) ...

Install: ``pip install "minillm[llamacpp]"`` (llama-cpp-python builds llama.cpp from source;
inside VMs with AMX, build without it: ``CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF
-DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"``, else a native build can die with an illegal instruction).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import MiniLLMError
from ..model import Transformer
from .clock import Clock

NAME = "llama.cpp"
INSTALL_HINT = ('llama-cpp-python is not installed: the llama.cpp engine was skipped (pip install '
                '"minillm[llamacpp]"; it compiles llama.cpp, minutes)')


def llama_cpp_available() -> bool:
    """Whether llama-cpp-python can be imported."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


class LlamaCppEngine:
    """llama.cpp (through llama-cpp-python's ``Llama``) on an F32 GGUF; batch 1 only.

    Args:
        gguf_path: the F32 GGUF of the model (see :func:`export_for_llama_cpp`).
        n_ctx: llama.cpp's context (KV cache positions).
        threads: llama.cpp's threads for decode and prefill (default: torch's thread count).
    Raises ImportError without llama-cpp-python.
    """

    name = NAME
    max_batch_size = 1

    def __init__(self, gguf_path: str | Path, n_ctx: int, threads: int | None = None):
        from llama_cpp import GGML_TYPE_F32, Llama

        threads = threads or torch.get_num_threads()
        self.llm = Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_batch=min(n_ctx, 2048), n_threads=threads,
                         n_threads_batch=threads, logits_all=False, verbose=False,
                         type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32)  # a float32 KV cache, as minillm's (default f16)

    def ttft(self, ids: torch.Tensor) -> Clock:
        _check_batch(ids)
        self.llm.reset()
        clock = Clock()
        clock(self._eval(ids[0].tolist()))
        return clock

    def prepare_decode(self, ids: torch.Tensor, n_new: int) -> None:
        _check_batch(ids)
        self.llm.reset()
        self.llm.eval(ids[0, :-1].tolist())

    def decode(self, ids: torch.Tensor, state, n_new: int) -> Clock:
        self.llm.n_tokens = ids.shape[1] - 1  # the next eval first drops the KV cache past this
        clock = Clock()
        token = self._eval(ids[0, -1:].tolist())
        clock(token)
        for _ in range(n_new - 1):
            token = self._eval(token.tolist())
            clock(token)
        return clock

    def _eval(self, tokens: list[int]) -> torch.Tensor:
        """Run tokens through llama.cpp; the greedy next token [1] from the last position's logits."""
        import llama_cpp
        import numpy as np

        self.llm.eval(tokens)
        logits = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)  # a pointer to n_vocab floats, no copy
        return torch.from_numpy(np.ctypeslib.as_array(logits, shape=(self.llm.n_vocab(),))).argmax().reshape(1)


def export_for_llama_cpp(model: Transformer) -> Path:
    """The model's F32 GGUF in ``<weights_dir>/_llama_cpp/<model folder>-f32.gguf``, written once
    (about the size of model.safetensors). Raises ModelNotFoundError without a source GGUF."""
    from ..formats.gguf_export import find_metadata_gguf, write_f32_gguf
    from ..formats.weights import weights_dir

    path = weights_dir() / "_llama_cpp" / f"{model.source.name}-f32.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        write_f32_gguf(model, find_metadata_gguf(model), partial)
        partial.replace(path)
    return path


def make_llama_cpp_engine(model: Transformer, n_ctx: int) -> tuple[LlamaCppEngine | None, str | None]:
    """(the engine, None), or (None, why it was skipped): llama-cpp-python missing, no GGUF metadata."""
    if not llama_cpp_available():
        return None, INSTALL_HINT
    try:
        return LlamaCppEngine(export_for_llama_cpp(model), n_ctx), None
    except (ValueError, MiniLLMError) as e:  # not a Llama-family float32 model, no GGUF to copy from
        return None, f"llama.cpp engine skipped: {e}"


def _check_batch(ids: torch.Tensor) -> None:
    if ids.shape[0] != 1:
        raise ValueError(f"the llama.cpp engine runs batch 1, got a batch of {ids.shape[0]}")
