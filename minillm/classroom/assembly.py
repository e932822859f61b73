"""The student's pieces assembled into one engine: the real model answers with their code.

Each core exercise writes one piece of minillm's inference path. :func:`assemble` runs a model
twice on one prompt, greedy (or with a seed): once with minillm's own pieces, once with the
student's swapped in wherever they are written, and compares the two runs token by token and
logit by logit::

    ex01 causal_mask            the mask inside eager attention
    ex02/ex04 eager_attention   every layer's attention (ex04's when the model has GQA)
    ex03 RotaryEmbedding.forward, apply_rope    the cos/sin tables, the rotation of q and k
    ex05 KVCache.write, keys, values            the cache every layer writes and reads back
    ex06 prefill, ex07 decode_step              the two phases
    ex08 filter_logits, sample                  picking each token
    ex14 generate                               the loop around them

The model must be the lesson's plain PyTorch (``load_model(..., fast=False, attn_impl="eager")``):
the speed layer replaces attention and the decode step, and would bypass the student's code.

The swap is done from here, for the length of one run: the names the core's modules look up at
call time (``minillm.model.causal_mask``, ``.eager_attention``, ``.apply_rope``,
``minillm.sampling.filter_logits``, ``minillm.generate``'s ``prefill``, ``decode_step``, ``sample``)
and the same names in the student's own modules, where they still point at minillm's, are set to
the student's functions and restored afterwards; the model's ``rope`` takes the student's class.
The core imports nothing from this module.

A piece whose stub still raises NotImplementedError, whose file is missing, or that crashes on
a tiny probe is replaced by minillm's, and the report says which and why.

When the two runs differ, :func:`find_culprit` names the piece: it swaps the student's pieces in
cumulatively, in the order of the table above, and bisects for the first one whose swap changes
minillm's answer (about log2(pieces) more runs)::

    pieces swapped:   (none)  ex01  ex01..ex03  ex01..ex05  ...  all
    answer:           same    same  same        DIFFERS          DIFFERS   ->  the culprit lies in ex04..ex05

Then the run with the culprit is compared with minillm's block by block (a hook on each block's
output, every forward pass): the first layer, pass and token position whose hidden state differs
beyond tolerance, else the logits, else the token picked.
"""

from __future__ import annotations

import contextlib
import importlib.util
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .. import model as model_module
from .. import phases, rope, sampling
from ..kv_cache import KVCache
from ..model import Transformer
from ..sampling import SamplingParams

generate_module = importlib.import_module("minillm.generate")  # the module: minillm's package exports its function

CORE_EXERCISES = ("ex01", "ex02", "ex03", "ex04", "ex05", "ex06", "ex07", "ex08", "ex14")
DEFAULT_PROMPT = "What is the capital of France?"
LOGITS_TOLERANCE = 1e-3  # float32 logits of a real model: a correct piece that adds in another order differs by ~1e-5
HIDDEN_RTOL = 1e-3  # hidden states: |diff| <= tolerance + HIDDEN_RTOL·|minillm's| (a residual stream reaches ~100)

# exercise, its file, the piece it writes (a function, or Class.method of a subclass of minillm's class)
PIECES = (
    ("ex01", "ex01_causal_mask.py", "causal_mask"),
    ("ex02", "ex02_attention.py", "eager_attention"),
    ("ex03", "ex03_rope.py", "RotaryEmbedding.forward"),
    ("ex03", "ex03_rope.py", "apply_rope"),
    ("ex04", "ex04_gqa.py", "eager_attention"),
    ("ex05", "ex05_kv_cache.py", "KVCache.write"),
    ("ex05", "ex05_kv_cache.py", "KVCache.keys"),
    ("ex05", "ex05_kv_cache.py", "KVCache.values"),
    ("ex06", "ex06_prefill.py", "prefill"),
    ("ex07", "ex07_decode_step.py", "decode_step"),
    ("ex08", "ex08_sampling.py", "filter_logits"),
    ("ex08", "ex08_sampling.py", "sample"),
    ("ex14", "ex14_generate.py", "generate"),
)


class AssemblyError(Exception):
    """A student's piece gave an answer the engine cannot go on with (keys() disagreeing with write())."""


class PieceTimeout(BaseException):
    """A student's file or piece ran past the time limit (an endless loop?): the message names it.

    A BaseException, so that the probes' ``except Exception`` (a crash: minillm's piece instead)
    lets it through: a piece that never returns stops the whole run."""


@contextlib.contextmanager
def _time_limit(seconds: float | None, what: str, folder: Path):
    """Raise PieceTimeout in whatever runs after ``seconds`` (SIGALRM: the student's code is Python,
    so the alarm interrupts even ``while True: pass``). Only on the main thread of a system with
    SIGALRM; no limit elsewhere, or when ``seconds`` is None. The previous handler is restored."""
    if not seconds or not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise PieceTimeout(f"{what}{_where_frame(frame, folder)} ran over {seconds:g} s and was stopped "
                           "(an endless loop?); --timeout SECONDS sets the limit")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _where_frame(frame, folder: Path) -> str:
    """' (ex01_causal_mask.py, line 3)': the innermost of the student's frames running at ``frame``."""
    while frame is not None:
        if Path(frame.f_code.co_filename).resolve().parent == folder:
            return f" ({Path(frame.f_code.co_filename).name}, line {frame.f_lineno})"
        frame = frame.f_back
    return ""


@dataclass(frozen=True)
class Piece:
    """One piece of the engine and whose code ran it.

    status: "yours" (the student's code ran), "not attempted" (the stub still raises
    NotImplementedError), "no file", "crashed" (import or probe failed: ``detail`` says how),
    "not used" (written, but another piece covers it: ``detail`` says why). Only "yours" runs
    the student's code; every other status runs minillm's.
    """

    exercise: str
    file: str
    name: str
    status: str
    detail: str = ""

    @property
    def yours(self) -> bool:
        return self.status == "yours"


@dataclass
class Run:
    """One engine's answer: its tokens, its logits (prefill's, then each decode step's), its time."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prefill_logits: list[torch.Tensor] = field(default_factory=list)
    decode_logits: list[torch.Tensor] = field(default_factory=list)
    hidden: list[list[torch.Tensor]] = field(default_factory=list)  # [pass][layer]: each block's output [B, T, d_model]
    seconds: float = 0.0
    error: str | None = None  # the exception that stopped the run, with the student's line


@dataclass(frozen=True)
class Divergence:
    """Where a run first leaves minillm's, in the order the engine computes.

    kind: "layer" (a block's output differs: ``layer``, ``position``, ``max_diff``), "layers" (the
    pass ran another number of blocks), "logits" (every block agrees, the logits do not), "token"
    (blocks and logits agree, the token picked differs: ``token``), "stop" (the same tokens, another
    length or finish reason), "error" (the run stopped with ``error`` before differing).
    pass_index: 0 for the prefill, j for decode step j. position: the token's position in the
    sequence (0 = the prompt's first token).
    """

    kind: str
    pass_index: int = 0
    layer: int | None = None
    n_layers: int = 0
    position: int | None = None
    max_diff: float | None = None
    token: int | None = None
    error: str | None = None  # "error": the exception; "stop": how the two runs end

    @property
    def phase(self) -> str:
        return "the prefill" if self.pass_index == 0 else f"decode step {self.pass_index}"

    def describe(self) -> str:
        """One sentence, e.g. "the output of layer 0 (of 30) first differs at position 1 (the prefill), by 2.3"."""
        if self.kind == "layer":
            return (f"the output of layer {self.layer} (of {self.n_layers}) first differs at position {self.position} "
                    f"({self.phase}), by up to {_num(self.max_diff)}")
        if self.kind == "layers":
            return f"{self.phase} ran another number of layers than minillm's {self.n_layers}"
        if self.kind == "logits":
            return (f"every layer's output agrees, but the logits of {self.phase} (position {self.position}) differ "
                    f"by up to {_num(self.max_diff)}")
        if self.kind == "token":
            return (f"every layer's output and the logits agree; the token picked first differs at token "
                    f"{self.token}")
        if self.kind == "stop":
            return f"the tokens agree as far as both go, but {self.error}"
        return f"it stopped with {self.error}"


@dataclass(frozen=True)
class Culprit:
    """The first of the student's pieces whose swap changes minillm's answer, and where it first shows."""

    piece: Piece
    where: Divergence
    runs: int  # the engine runs the bisection took
    before: tuple[Piece, ...] = ()  # the student's pieces swapped in before it, which kept minillm's answer

    @property
    def label(self) -> str:
        return piece_label(self.piece)


def piece_label(p: Piece) -> str:
    """"ex03 rope: apply_rope": the exercise, its file's name after the number, the piece."""
    return f"{p.exercise} {Path(p.file).stem.partition('_')[2]}: {p.name}"


@dataclass
class AssemblyReport:
    """The two runs and what differs. ``equal`` is the verdict: exit 0 when True.

    ``culprit``: when the runs differ, the first of the student's pieces that makes them differ
    (None when they agree, or when no piece of the student's changes the answer by itself)."""

    pieces: tuple[Piece, ...]
    prompt_ids: list[int]
    params: SamplingParams
    yours: Run
    minillm: Run
    tolerance: float = LOGITS_TOLERANCE
    culprit: Culprit | None = None

    @property
    def crashed(self) -> list[Piece]:
        return [p for p in self.pieces if p.status == "crashed"]

    @property
    def tokens_equal(self) -> bool:
        return _tokens_equal(self.yours, self.minillm)

    @property
    def first_difference(self) -> int | None:
        """The index of the first token that differs (None when the tokens are equal)."""
        return _first_difference(self.yours, self.minillm)

    @property
    def prefill_diff(self) -> float | None:
        """max |yours - minillm's| over the prefill's logits (the whole vocabulary), None if either has none."""
        return _prefill_diff(self.yours, self.minillm)

    @property
    def decode_diff(self) -> tuple[float | None, int]:
        """max |diff| over the decode steps both took from the same tokens, and how many there were."""
        return _decode_diff(self.yours, self.minillm)

    @property
    def equal(self) -> bool:
        return not self.crashed and runs_agree(self.yours, self.minillm, self.tolerance)


def runs_agree(yours: Run, ours: Run, tolerance: float = LOGITS_TOLERANCE) -> bool:
    """The same tokens and finish reason, no error, and the logits within ``tolerance``."""
    diff, _ = _decode_diff(yours, ours)
    prefill = _prefill_diff(yours, ours)
    return (yours.error is None and ours.error is None and _tokens_equal(yours, ours)
            and prefill is not None and prefill <= tolerance and (diff is None or diff <= tolerance))


def _tokens_equal(a: Run, b: Run) -> bool:
    return a.token_ids == b.token_ids and a.finish_reason == b.finish_reason


def _first_difference(yours: Run, ours: Run) -> int | None:
    a, b = yours.token_ids, ours.token_ids
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return None if a == b else i


def _prefill_diff(yours: Run, ours: Run) -> float | None:
    if not (yours.prefill_logits and ours.prefill_logits):
        return None
    return _max_diff(yours.prefill_logits[0], ours.prefill_logits[0])


def _decode_diff(yours: Run, ours: Run) -> tuple[float | None, int]:
    same = _first_difference(yours, ours)
    n = min(len(yours.decode_logits), len(ours.decode_logits))
    n = n if same is None else min(n, same)  # step j decodes token j: equal inputs while tokens 0..j agree
    diffs = [_max_diff(a, b) for a, b in zip(yours.decode_logits[:n], ours.decode_logits[:n])]
    return (max(diffs) if diffs else None), n


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


# -- the student's pieces -------------------------------------------------------------------------


def load_pieces(student_dir: Path, model: Transformer,
                timeout_s: float | None = None) -> tuple[tuple[Piece, ...], dict[str, object], list]:
    """Import the student's files and probe each piece on a tiny input.

    Returns (the pieces and their status, {piece name: the student's object to use},
    the student's modules). The chosen objects are functions, except "RotaryEmbedding" and
    "KVCache" (the student's classes) with "KVCache.methods" (the set of methods written).
    Raises PieceTimeout when importing a file or probing a piece takes over ``timeout_s`` seconds.
    """
    student_dir = Path(student_dir).resolve()
    _importable_kit()
    modules: dict[str, object] = {}
    load_errors: dict[str, str] = {}
    for _, file, _ in PIECES:
        if file in modules or file in load_errors or not (student_dir / file).is_file():
            continue
        try:
            with _time_limit(timeout_s, f"importing {file}", student_dir):
                modules[file] = _load_module(student_dir / file)
        except Exception as e:  # noqa: BLE001 - a file that does not import: say so, use minillm's
            load_errors[file] = f"importing {file} raised {type(e).__name__}: {e}"
    probes = _probes(model)
    statuses: dict[tuple[str, str], tuple[str, str]] = {}
    for ex, file, name in PIECES:
        if file in load_errors:
            statuses[ex, name] = ("crashed", load_errors[file])
        elif file not in modules:
            statuses[ex, name] = ("no file", f"no {file} in {student_dir}")
        else:
            obj = _attribute(modules[file], name)
            if obj is None:
                statuses[ex, name] = ("crashed", f"{file} defines no {name} (keep the names of the stub)")
                continue
            with _time_limit(timeout_s, f"{ex}'s {name}", student_dir):
                statuses[ex, name] = _probe(probes[ex, name], modules[file], student_dir)
    chosen: dict[str, object] = {}
    gqa = model.config.n_kv_heads != model.config.n_heads
    for name, ex in (("causal_mask", "ex01"), ("apply_rope", "ex03"), ("prefill", "ex06"),
                     ("decode_step", "ex07"), ("filter_logits", "ex08"), ("sample", "ex08"), ("generate", "ex14")):
        if statuses[ex, name][0] == "yours":
            chosen[name] = getattr(modules[_file(ex)], name)
    if statuses["ex04", "eager_attention"][0] == "yours":
        chosen["eager_attention"] = modules[_file("ex04")].eager_attention
        if statuses["ex02", "eager_attention"][0] == "yours":
            statuses["ex02", "eager_attention"] = ("not used", "exercise 4's attention (GQA) covers it")
    elif statuses["ex02", "eager_attention"][0] == "yours":
        if gqa:
            statuses["ex02", "eager_attention"] = (
                "not used", f"this model has grouped-query attention ({model.config.n_heads} query heads, "
                            f"{model.config.n_kv_heads} K/V heads): write exercise 4")
        else:
            chosen["eager_attention"] = modules[_file("ex02")].eager_attention
    if statuses["ex03", "RotaryEmbedding.forward"][0] == "yours":
        if model.rope is None:
            statuses["ex03", "RotaryEmbedding.forward"] = ("not used", "this model has learned positions, no RoPE")
        else:
            chosen["RotaryEmbedding"] = modules[_file("ex03")].RotaryEmbedding
    if model.rope is None and statuses["ex03", "apply_rope"][0] == "yours":
        statuses["ex03", "apply_rope"] = ("not used", "this model has learned positions, no RoPE")
        chosen.pop("apply_rope", None)
    written = {m for m in ("write", "keys", "values") if statuses["ex05", f"KVCache.{m}"][0] == "yours"}
    if written:
        chosen["KVCache"], chosen["KVCache.methods"] = modules[_file("ex05")].KVCache, written
    pieces = tuple(Piece(ex, file, name, *statuses[ex, name]) for ex, file, name in PIECES)
    return pieces, chosen, list(modules.values())


def _file(exercise: str) -> str:
    return next(file for ex, file, _ in PIECES if ex == exercise)


def _attribute(module, name: str):
    cls_name, _, method = name.partition(".")
    obj = getattr(module, cls_name, None)
    if obj is None or not method:
        return obj
    bases = {"RotaryEmbedding": rope.RotaryEmbedding, "KVCache": KVCache}
    if not (isinstance(obj, type) and issubclass(obj, bases[cls_name])):
        return None
    return getattr(obj, method, None)


def _importable_kit() -> None:
    """Put the checkout's tests/ on sys.path, as the checks do: a student's file may import the kit's helpers."""
    from .grading import find_checkout
    from ..errors import MiniLLMError

    try:
        tests = str(find_checkout() / "tests")
    except MiniLLMError:
        return
    if tests not in sys.path:
        sys.path.append(tests)


def _load_module(path: Path):
    """Import a student's file as a fresh module (its latest code)."""
    name = f"student_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look a module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _probes(model: Transformer) -> dict[tuple[str, str], Callable]:
    """A tiny call of each piece: module -> its answer (minillm's other pieces around it)."""
    cfg = model.config
    H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    param = next(model.parameters())

    def randn(*shape):
        return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(param.device, param.dtype)

    def cache(max_seq_len=4, cls=KVCache):
        return cls.for_model(model, max_seq_len=max_seq_len)

    def kv_method(name):
        def probe(m):
            c = m.KVCache(1, 1, Hkv, 4, D, dtype=param.dtype, device=param.device)  # super() needs the student's class
            k, v = randn(1, Hkv, 2, D), randn(1, Hkv, 2, D)
            if name != "write":
                KVCache.write(c, 0, k, v)
                c.advance(2)
            return getattr(m.KVCache, name)(c, 0, k, v) if name == "write" else getattr(m.KVCache, name)(c, 0)
        return probe

    def rope_forward(m):
        if model.rope is None:
            return None
        return m.RotaryEmbedding(cfg).to(param.device).forward(torch.arange(3, device=param.device), param.dtype)

    def apply(m):
        cos, sin = rope.RotaryEmbedding(cfg).to(param.device)(torch.arange(3, device=param.device), param.dtype)
        return m.apply_rope(randn(1, Hkv, 3, D), cos, sin)

    def decode(m):
        c = cache()
        phases.prefill(model, torch.tensor([[1, 2]], device=param.device), c)
        return m.decode_step(model, torch.tensor([3], device=param.device), c)

    def generate(m):
        params = SamplingParams(temperature=0, max_new_tokens=2)
        return list(m.generate(model, torch.tensor([1, 2], device=param.device), params, cache(), set()))

    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    with_grad_off = torch.inference_mode
    probes = {
        # called as the engine calls them: eager attention passes (T, S, device, window) on to the mask,
        # the attention layer passes (q, k, v, hook, name, scale, window)
        ("ex01", "causal_mask"): lambda m: m.causal_mask(3, 5, param.device, None),
        ("ex02", "eager_attention"): lambda m: m.eager_attention(randn(1, 2, 3, D), randn(1, 2, 5, D),
                                                                 randn(1, 2, 5, D), None, "probe", D ** -0.5, None),
        ("ex04", "eager_attention"): lambda m: m.eager_attention(randn(1, H, 3, D), randn(1, Hkv, 5, D),
                                                                 randn(1, Hkv, 5, D), None, "probe", D ** -0.5, None),
        ("ex03", "RotaryEmbedding.forward"): rope_forward,
        ("ex03", "apply_rope"): apply,
        ("ex05", "KVCache.write"): kv_method("write"),
        ("ex05", "KVCache.keys"): kv_method("keys"),
        ("ex05", "KVCache.values"): kv_method("values"),
        ("ex06", "prefill"): lambda m: m.prefill(model, torch.tensor([[1, 2]], device=param.device), cache()),
        ("ex07", "decode_step"): decode,
        ("ex08", "filter_logits"): lambda m: m.filter_logits(logits, SamplingParams(temperature=0.8, top_k=10,
                                                                                   top_p=0.9)),
        ("ex08", "sample"): lambda m: m.sample(logits, SamplingParams(temperature=0)),
        ("ex14", "generate"): generate,
    }
    return {key: (lambda m, fn=fn: _no_grad(with_grad_off, fn, m)) for key, fn in probes.items()}


def _no_grad(mode, fn, m):
    with mode():
        return fn(m)


def _probe(probe: Callable, module, student_dir: Path) -> tuple[str, str]:
    try:
        probe(module)
    except NotImplementedError as e:
        if _raised_in(e, student_dir):
            return "not attempted", ""
        return "crashed", f"NotImplementedError: {e}"
    except Exception as e:  # noqa: BLE001 - any crash: minillm's piece runs instead, and the report says so
        return "crashed", f"{type(e).__name__}: {e}{_where(e, student_dir)}"
    return "yours", ""


def _raised_in(error: BaseException, folder: Path) -> bool:
    """Whether the innermost frame of the traceback is a file of ``folder`` (the stub's raise)."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and Path(tb.tb_frame.f_code.co_filename).resolve().parent == folder


def _where(error: BaseException, folder: Path | None) -> str:
    """' (your ex03_rope.py, line 12)': the student's innermost line in the traceback, if any."""
    if folder is None:
        return ""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if Path(f.filename).resolve().parent == folder]
    return f" ({Path(frames[-1].filename).name}, line {frames[-1].lineno})" if frames else ""


# -- running the engine ---------------------------------------------------------------------------


def assemble(model: Transformer, prompt_ids: list[int], params: SamplingParams, eos_token_ids,
             student_dir: Path, timeout_s: float | None = None) -> AssemblyReport:
    """Run ``model`` on ``prompt_ids`` with minillm's pieces, then with the student's; compare.

    ``model`` should be the lesson's plain PyTorch with eager attention (``load_model(...,
    fast=False, attn_impl="eager")``); raises ValueError otherwise, since the speed layer or
    SDPA would run instead of the student's attention and mask.

    ``timeout_s``: the most seconds importing one of the student's files or probing one piece may
    take, and the student's engine beyond the time minillm's took; past it, PieceTimeout (its
    message names the file and line). None: no limit.
    """
    if model.attn_impl != "eager":
        raise ValueError("the assembled engine needs the lesson's eager attention: "
                         "load_model(..., fast=False, attn_impl='eager')")
    if getattr(model, "decode_path", None) is not None:
        raise ValueError("the assembled engine needs the lesson's plain PyTorch: load_model(..., fast=False)")
    folder = Path(student_dir).resolve()
    pieces, chosen, modules = load_pieces(student_dir, model, timeout_s)
    eos = set(eos_token_ids)
    ours = run_engine(model, prompt_ids, params, eos, {}, [], None)
    limit = None if timeout_s is None else timeout_s + ours.seconds
    with _time_limit(limit, "your engine's run", folder):
        yours = run_engine(model, prompt_ids, params, eos, chosen, modules, folder)
    report = AssemblyReport(pieces, list(prompt_ids), params, yours, ours)
    if not runs_agree(yours, ours, report.tolerance):
        def run(part: dict, n_tokens: int | None) -> Run:
            with _time_limit(limit, "your engine's run", folder):
                return run_engine(model, prompt_ids, params, eos, part, modules, folder, n_tokens)

        report.culprit = find_culprit(_units(pieces, chosen), run, ours, yours, len(model.blocks), report.tolerance)
    return report


def find_culprit(units: list[tuple[Piece, dict]], run: Callable[[dict, int | None], Run], ours: Run, yours: Run,
                 n_layers: int, tolerance: float = LOGITS_TOLERANCE) -> Culprit | None:
    """The first unit whose swap, after the units before it, changes ``ours``; bisected.

    units: (piece, the part of ``chosen`` it swaps in), in exercise order. run(part, n_tokens):
    one engine run with ``part`` swapped in, stopped after n_tokens tokens (None: to its end).
    ``yours`` is the run with every unit (known to differ). With no swap the answer is
    minillm's; with all of them it differs: halving the range between the longest prefix known
    to agree and the shortest known to differ finds a unit with an agreeing prefix before it
    and a differing one with it, in ceil(log2(units)) runs. Each run goes only as far as the
    token where ``yours`` first differs (a RoPE mistake: the prefill and one token), so the
    piece named is the first that changes the answer that early.
    """
    if not units:
        return None
    n_tokens = _horizon(first_divergence(yours, ours, n_layers, tolerance))
    target = ours if n_tokens is None else _cut(ours, n_tokens)
    agree, differ, differing, runs = 0, len(units), yours, 0
    while differ - agree > 1:
        mid = (agree + differ) // 2
        candidate = run(_merged(part for _, part in units[:mid]), n_tokens)
        runs += 1
        if runs_agree(candidate, target, tolerance):
            agree = mid
        else:
            differ, differing = mid, candidate
    where = first_divergence(differing, target, n_layers, tolerance)
    return Culprit(units[differ - 1][0], where, runs, tuple(p for p, _ in units[:differ - 1]))


def _horizon(where: Divergence) -> int | None:
    """The tokens a run needs to show ``where``: pass p yields token p; None: the whole run."""
    if where.kind in ("layer", "layers", "logits"):
        return where.pass_index + 1
    return where.token + 1 if where.kind == "token" else None


def _cut(run: Run, n_tokens: int) -> Run:
    """``run`` as if stopped after its first n_tokens tokens (as run_engine(..., n_tokens) stops)."""
    if len(run.token_ids) <= n_tokens:
        return run
    return Run(run.token_ids[:n_tokens], None, run.prefill_logits, run.decode_logits[:n_tokens - 1],
               run.hidden[:n_tokens], run.seconds, run.error)


def _units(pieces: tuple[Piece, ...], chosen: dict[str, object]) -> list[tuple[Piece, dict]]:
    """The student's pieces that run, each with the part of ``chosen`` that swaps it in alone."""
    units = []
    for p in pieces:
        if not p.yours:
            continue
        if p.name.startswith("KVCache."):
            part = {"KVCache": chosen["KVCache"], "KVCache.methods": {p.name.partition(".")[2]}}
        else:
            key = p.name.partition(".")[0]  # "RotaryEmbedding.forward": the student's class
            part = {key: chosen[key]}
        units.append((p, part))
    return units


def _merged(parts) -> dict:
    merged: dict = {}
    for part in parts:
        for key, value in part.items():
            merged[key] = merged.get(key, set()) | value if key == "KVCache.methods" else value
    return merged


def first_divergence(yours: Run, ours: Run, n_layers: int, tolerance: float = LOGITS_TOLERANCE) -> Divergence:
    """Where ``yours`` first leaves ``ours``: pass by pass while the tokens fed in agree, each block's
    output (the earliest layer, then the earliest position), then the pass's logits; then the tokens.

    Hidden states count as different past ``tolerance + HIDDEN_RTOL·|minillm's|``.
    """
    same = _first_difference(yours, ours)
    n_same = len(ours.token_ids) if same is None else same
    start = 0  # the position of the pass's first token
    for p in range(min(len(yours.hidden), len(ours.hidden), n_same + 1)):  # pass p reads tokens 0..p-1
        mine, theirs = yours.hidden[p], ours.hidden[p]
        for layer, (a, b) in enumerate(zip(mine, theirs)):
            if a.shape != b.shape:
                return Divergence("layer", p, layer, n_layers, start, float("inf"))
            bad = (a - b).abs() > tolerance + HIDDEN_RTOL * b.abs()
            if bool(bad.any()):
                t = int(bad.any(-1).any(0).nonzero()[0])  # [B, T, d_model]: the first position
                return Divergence("layer", p, layer, n_layers, start + t, float((a[:, t] - b[:, t]).abs().max()))
        if len(mine) != len(theirs):
            return Divergence("layers", p, n_layers=len(theirs))
        logits = (yours.prefill_logits, ours.prefill_logits) if p == 0 else \
            (yours.decode_logits[p - 1:p], ours.decode_logits[p - 1:p])
        if logits[0] and logits[1] and _max_diff(logits[0][0], logits[1][0]) > tolerance:
            end = start + theirs[0].shape[1] - 1 if theirs else start
            return Divergence("logits", p, position=end, max_diff=_max_diff(logits[0][0], logits[1][0]))
        start += theirs[0].shape[1] if theirs else 0
    if same is not None and same < min(len(yours.token_ids), len(ours.token_ids)):
        return Divergence("token", token=same)
    if yours.error is not None:
        return Divergence("error", error=yours.error)
    return Divergence("stop", error=f"yours stops after {len(yours.token_ids)} tokens ({yours.finish_reason}), "
                                    f"minillm's after {len(ours.token_ids)} ({ours.finish_reason})")


def run_engine(model: Transformer, prompt_ids: list[int], params: SamplingParams, eos: set[int],
               chosen: dict[str, object], modules: list, student_dir: Path | None,
               n_tokens: int | None = None) -> Run:
    """One generation with the ``chosen`` pieces swapped in (none: minillm's own), recording logits
    and every block's output; stopped after ``n_tokens`` tokens when given (the last one not decoded)."""
    run = Run()
    cache_cls = _cache_class(chosen.get("KVCache"), chosen.get("KVCache.methods", set()))
    cfg = model.config
    param = next(model.parameters())
    cache = cache_cls.for_model(model, max_seq_len=min(cfg.max_seq_len, len(prompt_ids) + params.max_new_tokens))
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=param.device)
    loop = chosen.get("generate") or (lambda m, p, sp, c, e: generate_module.generate(m, p, sp, c, eos_token_ids=e))
    start = time.perf_counter()
    try:
        with _swapped(model, chosen, modules, run), _recording_blocks(model, run.hidden), torch.inference_mode():
            for step in loop(model, ids, params, cache, eos):
                run.token_ids.append(step.token_id)
                run.finish_reason = step.finish_reason
                if n_tokens is not None and len(run.token_ids) >= n_tokens:
                    break
    except Exception as e:  # noqa: BLE001 - reported, with the student's line
        run.error = f"{type(e).__name__}: {e}{_where(e, student_dir)}"
    run.seconds = time.perf_counter() - start
    return run


@contextlib.contextmanager
def _recording_blocks(model: Transformer, into: list[list[torch.Tensor]]):
    """A forward hook on each block: its output appended to ``into[-1]``; block 0 starts a new pass."""
    def hook(layer: int):
        def record(module, args, output):
            if layer == 0 or not into:
                into.append([])
            into[-1].append(output.detach().float().cpu().clone())
        return record

    handles = [block.register_forward_hook(hook(i)) for i, block in enumerate(model.blocks)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _recording(fn: Callable, into: list) -> Callable:
    def recorded(*args, **kwargs):
        logits = fn(*args, **kwargs)
        into.append(logits.detach().float().cpu().clone())
        return logits
    recorded.__wrapped__ = fn
    return recorded


@contextlib.contextmanager
def _swapped(model: Transformer, chosen: dict[str, object], modules: list, run: Run):
    """Point the names the engine looks up at the chosen pieces (minillm's elsewhere); restore them after."""
    minillm_pieces = {"causal_mask": model_module.causal_mask, "eager_attention": model_module.eager_attention,
                      "apply_rope": rope.apply_rope, "filter_logits": sampling.filter_logits,
                      "sample": sampling.sample, "prefill": phases.prefill, "decode_step": phases.decode_step}
    new = {name: chosen.get(name, ref) for name, ref in minillm_pieces.items()}
    new["prefill"] = _recording(new["prefill"], run.prefill_logits)
    new["decode_step"] = _recording(new["decode_step"], run.decode_logits)
    targets = [(model_module, "causal_mask"), (model_module, "eager_attention"), (model_module, "apply_rope"),
               (rope, "apply_rope"), (sampling, "filter_logits"), (sampling, "sample"), (phases, "prefill"),
               (phases, "decode_step"), (generate_module, "prefill"), (generate_module, "decode_step")]
    # the student's modules: names imported from minillm (ex02's causal_mask, ex14's prefill, ...)
    # and the modules the chosen functions were defined in (a file may import its loop from elsewhere)
    homes = [sys.modules[f.__module__] for f in chosen.values() if callable(f) and getattr(f, "__module__", None)
             in sys.modules]
    spaces = list({id(m): m for m in [*modules, *homes]}.values())
    targets += [(m, name) for m in spaces for name, ref in minillm_pieces.items()
                if getattr(m, name, None) is ref and (m, name) not in targets]
    saved = [(m, name, getattr(m, name)) for m, name in targets]
    rope_class = type(model.rope) if model.rope is not None else None
    try:
        for m, name in targets:
            setattr(m, name, new[name])
        if model.rope is not None and "RotaryEmbedding" in chosen:
            model.rope.__class__ = chosen["RotaryEmbedding"]
        yield
    finally:
        for m, name, value in saved:
            setattr(m, name, value)
        if rope_class is not None:
            model.rope.__class__ = rope_class


def _cache_class(student_cls: type | None, written: set[str]) -> type:
    """A KVCache whose write/keys/values are the student's where written (minillm's otherwise).

    Every layer writes through ``write`` and attends over what it returns, as minillm's cache
    does; then ``keys``/``values`` must read the same positions back, so all three methods count.
    """
    base = student_cls if student_cls is not None else KVCache
    methods = {m: getattr(KVCache, m) for m in ("write", "keys", "values") if m not in written}

    def attend(self, layer, q, k, v, attention, window=None):
        keys, values = self.write(layer, k, v)
        self.length += k.shape[2]  # keys()/values() read up to length: let them see this pass's entries
        try:
            read_k, read_v = self.keys(layer), self.values(layer)
        finally:
            self.length -= k.shape[2]
        for what, got, wrote in (("keys", read_k, keys), ("values", read_v, values)):
            if not (isinstance(got, torch.Tensor) and got.shape == wrote.shape and torch.equal(got, wrote)):
                shape = list(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                raise AssemblyError(f"KVCache.{what}({layer}) read back {shape}, not the {list(wrote.shape)} "
                                    f"{what} write() returned for the same positions")
        return attention(q, keys, values, None)

    return type("AssembledKVCache", (base,), {**methods, "attend": attend})


# -- the report -----------------------------------------------------------------------------------


def report_lines(report: AssemblyReport, decode: Callable[[list[int]], str], where: str) -> list[str]:
    """The report as text lines: the pieces' table, both answers, the comparison, the verdict."""
    lines = [f"The assembled engine: pieces from {where}", "",
             f"  {'exercise':<9} {'piece':<24} ran", f"  {'-' * 9} {'-' * 24} {'-' * 40}"]
    for p in report.pieces:
        ran = {"yours": "yours", "not attempted": "minillm's (not attempted)", "no file": "minillm's (no file)",
               "crashed": f"minillm's (yours crashed: {p.detail})",
               "not used": f"not used: {p.detail}"}[p.status]
        lines.append(f"  {p.exercise:<9} {p.name:<24} {ran}")
    n_yours = sum(p.yours for p in report.pieces)
    mode = "greedy" if report.params.greedy else f"temperature {report.params.temperature:g}, seed {report.params.seed}"
    lines += ["", f"{n_yours} of {len(report.pieces)} pieces are yours. Prompt: {len(report.prompt_ids)} tokens, "
                  f"{mode}, at most {report.params.max_new_tokens} new tokens.", ""]
    for who, run in (("yours:  ", report.yours), ("minillm:", report.minillm)):
        text = decode(run.token_ids)  # repr writes a newline as \n, once
        lines.append(f"{who} {text!r}  ({len(run.token_ids)} tokens, stop: {run.finish_reason}, {run.seconds:.2f} s)")
        if run.error:
            lines.append(f"         stopped by {run.error}")
    lines.append("")
    if report.tokens_equal:
        lines.append(f"tokens: identical ({len(report.yours.token_ids)} of {len(report.minillm.token_ids)})")
    else:
        i = report.first_difference
        a = report.yours.token_ids[i] if i is not None and i < len(report.yours.token_ids) else None
        b = report.minillm.token_ids[i] if i is not None and i < len(report.minillm.token_ids) else None
        if i is None:  # same tokens, another finish reason
            lines.append(f"tokens: the same, but stop {report.yours.finish_reason} instead of {report.minillm.finish_reason}")
        else:
            lines.append(f"tokens: differ from token {i}: yours {_token(a, decode)}, minillm's {_token(b, decode)}")
    diff = report.prefill_diff
    lines.append(f"prefill logits: max |diff| {_num(diff)} (float32 tolerance {report.tolerance:g})")
    ddiff, n = report.decode_diff
    lines.append(f"decode logits:  max |diff| {_num(ddiff)} over the {n} decode steps taken from the same tokens")
    lines.append("")
    if report.equal and n_yours == 0:  # minillm's pieces on both sides, and nothing of the student's ran
        lines.append("None of the pieces are yours yet: minillm's engine ran on both sides, so there is nothing "
                     "of yours to compare. Write an exercise (ex01 first) and run this again.")
    elif report.equal:
        lines.append("Your engine equals minillm's: the same answer, the same logits.")
    else:
        why = []
        if report.crashed:
            why.append(f"{len(report.crashed)} piece(s) crashed and minillm's ran instead")
        if report.yours.error:
            why.append("your engine stopped with an error")
        if not report.tokens_equal:
            why.append("the tokens differ")
        if diff is None and report.yours.error is None:
            why.append("no prefill logits came back from your engine (does your loop call prefill?)")
        elif (diff is not None and diff > report.tolerance) or (ddiff is not None and ddiff > report.tolerance):
            why.append("the logits differ beyond the tolerance")
        if report.culprit is None:
            lines.append(f"Your engine differs from minillm's: {'; '.join(why)}.")
        else:
            lines += culprit_lines(report.culprit, report, decode)
            lines.append(f"Your engine differs from minillm's: {'; '.join(why)}. The first piece that changes the "
                         f"answer: {report.culprit.label} ({_short_where(report.culprit.where)}).")
    return lines


def culprit_lines(culprit: Culprit, report: AssemblyReport, decode: Callable[[list[int]], str]) -> list[str]:
    """Which piece, found how, and where its run first leaves minillm's."""
    before = ", ".join(f"{p.exercise} {p.name}" for p in culprit.before) or "none"
    where = culprit.where.describe()
    if culprit.where.kind == "token":
        i = culprit.where.token
        where += f" (minillm's: {_token(report.minillm.token_ids[i], decode)})"
    elif culprit.where.kind == "layer":
        where += f" (tolerance {report.tolerance:g} + {HIDDEN_RTOL:g}·|minillm's|)"
    elif culprit.where.kind == "logits":
        where += f" (tolerance {report.tolerance:g})"
    how = (f"{culprit.runs} more run{'s' if culprit.runs != 1 else ''}, bisecting" if culprit.runs
           else "your only piece that runs")
    return [f"The culprit: {culprit.label}. Swapping your pieces into minillm's engine in exercise order "
            f"({how}), the answer first changes with this one.",
            f"  your pieces before it, which keep minillm's answer: {before}",
            f"  where it first differs: {where}", ""]


def _short_where(where: Divergence) -> str:
    if where.kind == "layer":
        return f"layer {where.layer}, position {where.position}, {where.phase}"
    if where.kind == "logits":
        return f"the logits of {where.phase}"
    if where.kind == "token":
        return f"the token picked at token {where.token}"
    return {"layers": "the number of layers run", "stop": "where the run stops"}.get(where.kind, "an error")


def _token(token_id, decode) -> str:
    return "nothing" if token_id is None else f"{decode([token_id])!r} (id {token_id})"


def _num(x: float | None) -> str:
    return "n/a" if x is None else ("0" if x == 0 else f"{x:.3g}")
