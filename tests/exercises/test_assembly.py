"""The assembled engine (minillm/classroom/assembly.py): the student's pieces running a whole model.

On a tiny random model: the references assembled equal minillm to the last bit, and one wrong
piece, whichever, shows up as a difference (so the swap really runs the student's code). Once on
the real default model through `minillm generate --student-dir`: the references answer "Paris"
with exit 0, a RoPE sign flip among them differs with exit 1 and is named, with its layer and position.
When the engine differs, the first wrong piece is named (bisecting over the student's pieces), with
the layer and token position where its run first leaves minillm's. `minillm check`'s engine runs in the
checks' sandbox: its report (the culprit's lines too) reaches the teacher, and a piece that writes to the
teacher's home or reads the student beside it when the engine calls it is refused.
"""

import io
import re
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from exercises.models import tiny_model
from rich.console import Console

from minillm.classroom import reference_answers, sandbox
from minillm.classroom.assembly import CORE_EXERCISES, PieceTimeout, assemble, report_lines
from minillm.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_new_tokens=6)
PROMPT = [3, 14, 15, 92, 65, 35, 89]


def minillm(*args):
    return subprocess.run([sys.executable, "-m", "minillm", *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return reference_answers(tmp_path_factory.mktemp("answers") / "reference")


def write(folder, files: dict[str, str]):
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(textwrap.dedent(text))
    return folder


def test_the_references_assembled_equal_minillm(references):
    report = assemble(tiny_model("llama_gqa", "eager"), PROMPT, GREEDY, set(), references)
    assert {p.status for p in report.pieces} == {"yours", "not used"}
    assert [p.exercise for p in report.pieces if p.status == "not used"] == ["ex02"]  # GQA: ex04's attention runs
    assert {p.exercise for p in report.pieces if p.yours} == set(CORE_EXERCISES) - {"ex02"}
    assert report.equal and report.tokens_equal and len(report.yours.token_ids) == 6
    assert report.prefill_diff == 0 and report.decode_diff == (0, 5)
    assert report_lines(report, str, "refs")[-1] == "Your engine equals minillm's: the same answer, the same logits."


def test_the_stubs_run_minillms_pieces_and_say_so():
    from minillm.classroom.grading import STUBS_DIR, find_checkout

    report = assemble(tiny_model("llama_gqa", "eager"), PROMPT, GREEDY, set(), find_checkout() / STUBS_DIR)
    assert {p.status for p in report.pieces} == {"not attempted"} and report.equal


def test_the_stubs_say_none_of_the_pieces_are_theirs_yet():
    from minillm.classroom.grading import STUBS_DIR, find_checkout

    report = assemble(tiny_model("llama_gqa", "eager"), PROMPT, GREEDY, set(), find_checkout() / STUBS_DIR)
    last = report_lines(report, str, "stubs")[-1]
    assert last.startswith("None of the pieces are yours yet") and "equals" not in last and report.equal


LOOP = "def causal_mask(*args, **kwargs):\n    while True:\n        pass\n"


def test_a_piece_that_loops_forever_is_stopped_and_named(tmp_path):
    folder = write(tmp_path, {"ex01_causal_mask.py": LOOP})
    with pytest.raises(PieceTimeout, match=r"ex01's causal_mask \(ex01_causal_mask.py, line [23]\) ran over 1 s"):
        assemble(tiny_model("llama_gqa", "eager"), PROMPT, GREEDY, set(), folder, timeout_s=1)
    assert signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, signal.default_int_handler, None)  # restored
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_file_that_loops_on_import_is_stopped_and_named(tmp_path):
    folder = write(tmp_path, {"ex03_rope.py": "while True:\n    pass\n"})
    with pytest.raises(PieceTimeout, match=r"importing ex03_rope.py \(ex03_rope.py, line [12]\) ran over 1 s"):
        assemble(tiny_model("llama_gqa", "eager"), PROMPT, GREEDY, set(), folder, timeout_s=1)


def test_a_missing_file_and_a_crash_fall_back_to_minillm_and_fail(tmp_path):
    folder = write(tmp_path, {"ex01_causal_mask.py": """\
        def causal_mask(n_queries, n_keys, device=None, window=None):
            return 1 / 0
        """})
    report = assemble(tiny_model("llama_gqa", "eager"), PROMPT, GREEDY, set(), folder)
    status = {(p.exercise, p.name): (p.status, p.detail) for p in report.pieces}
    assert status["ex01", "causal_mask"][0] == "crashed"
    assert "ZeroDivisionError: division by zero (ex01_causal_mask.py, line 2)" in status["ex01", "causal_mask"][1]
    assert status["ex06", "prefill"][0] == "no file"
    assert report.tokens_equal and not report.equal  # minillm's mask ran, but the student's crashed: not a pass
    assert "1 piece(s) crashed and minillm's ran instead" in report_lines(report, str, "x")[-1]


# One wrong piece per file (the file's other pieces are minillm's, imported); every other file is
# missing, so minillm's pieces run there. Each must change the answer, and be named as the culprit.
SIGN_FLIP = """\
    import torch
    from minillm.rope import RotaryEmbedding

    def apply_rope(x, cos, sin):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((x2, -x1), dim=-1) * sin  # the sign flipped: (-x2, x1)
    """
SOFTMAX_OVER_QUERIES = """\
    import torch
    from minillm.model import causal_mask

    def eager_attention(q, k, v, hook=None, name="", scale=None, window=None):
        B, H, T, D = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        q = q.reshape(B, Hkv, H // Hkv, T, D)
        scores = q @ k.unsqueeze(2).transpose(-1, -2) * (D ** -0.5 if scale is None else scale)
        scores = scores.masked_fill(~causal_mask(T, S, q.device, window), float("-inf"))
        return (torch.softmax(scores, dim=-2) @ v.unsqueeze(2)).reshape(B, H, T, D)  # over the queries
    """
WRONG = {
    "ex01 mask off by one": ("ex01_causal_mask.py", "causal_mask", """\
        from exercises.mistakes import mask_off_by_one

        def causal_mask(n_queries, n_keys, device=None, window=None):
            return mask_off_by_one(n_queries, n_keys, device)
        """),
    "ex04 queries scaled twice": ("ex04_gqa.py", "eager_attention", """\
        from minillm.model import eager_attention as minillms

        def eager_attention(q, k, v, hook=None, name="", scale=None, window=None):
            return minillms(q * 3, k, v, hook, name, scale, window)
        """),
    "ex04 softmax over the queries": ("ex04_gqa.py", "eager_attention", SOFTMAX_OVER_QUERIES),
    "ex03 sin negated": ("ex03_rope.py", "RotaryEmbedding.forward", """\
        from minillm import rope
        from minillm.rope import apply_rope

        class RotaryEmbedding(rope.RotaryEmbedding):
            def forward(self, positions, dtype):
                cos, sin = super().forward(positions, dtype)
                return cos, -sin
        """),
    "ex03 no rotation": ("ex03_rope.py", "apply_rope", """\
        from minillm.rope import RotaryEmbedding

        def apply_rope(x, cos, sin):
            return x
        """),
    "ex03 rotation sign flipped": ("ex03_rope.py", "apply_rope", SIGN_FLIP),
    "ex05 values written as keys": ("ex05_kv_cache.py", "KVCache.write", """\
        from minillm import kv_cache

        class KVCache(kv_cache.KVCache):
            def write(self, layer, k, v):
                return super().write(layer, k, k)
        """),
    "ex05 keys read back short": ("ex05_kv_cache.py", "KVCache.keys", """\
        from minillm import kv_cache

        class KVCache(kv_cache.KVCache):
            def keys(self, layer):
                return super().keys(layer)[:, :, 1:]
        """),
    "ex06 logits reversed": ("ex06_prefill.py", "prefill", """\
        from minillm.phases import prefill as minillms

        def prefill(model, token_ids, cache, hook=None, trace=None):
            return minillms(model, token_ids, cache, hook, trace).flip(-1)
        """),
    "ex07 logits reversed": ("ex07_decode_step.py", "decode_step", """\
        from minillm.phases import decode_step as minillms

        def decode_step(model, token_id, cache, hook=None, trace=None):
            return minillms(model, token_id, cache, hook, trace).flip(-1)
        """),
    "ex08 the next token id": ("ex08_sampling.py", "sample", """\
        from minillm.sampling import filter_logits, sample as minillms

        def sample(logits, params, generator=None, prompt_ids=None, output_ids=None):
            token, logprob = minillms(logits, params, generator, prompt_ids, output_ids)
            return (token + 1) % logits.shape[-1], logprob
        """),
    "ex14 the last token dropped": ("ex14_generate.py", "generate", """\
        from minillm.generate import generate as reference

        def generate(model, prompt_ids, params, cache, eos_token_ids):
            yield from list(reference(model, prompt_ids, params, cache, eos_token_ids))[:-1]
        """),
}


@pytest.mark.parametrize("mistake", WRONG)
def test_one_wrong_piece_changes_the_answer_and_is_named(tmp_path, mistake):
    file, piece, text = WRONG[mistake]
    report = assemble(tiny_model("llama_gqa", "eager"), PROMPT, GREEDY, set(), write(tmp_path, {file: text}))
    exercise = mistake.split()[0]
    assert not report.crashed and [p.name for p in report.pieces if p.exercise == exercise and p.yours]
    assert not report.equal, f"{mistake}: the assembled engine did not run the student's piece"
    assert (report.culprit.piece.exercise, report.culprit.piece.name) == (exercise, piece)
    last = report_lines(report, str, "x")[-1]
    assert last.startswith("Your engine differs from minillm's") and f"answer: {report.culprit.label} (" in last
    assert report.minillm.error is None and report.minillm.token_ids  # minillm's own run is untouched


def otherwise_reference(references, folder, file: str, text: str):
    """A copy of the reference answers with one file replaced."""
    for path in references.iterdir():
        if path.suffix == ".py":
            write(folder, {path.name: path.read_text()})
    return write(folder, {file: text})


# the culprit among every other piece of the reference's, and the first layer and position where it shows:
# RoPE rotates position 0 by angle 0, so a sign flip first shows at position 1; attention over the
# wrong axis changes the very first token's output
PLANTED = {"ex03 rotation sign flipped": ("ex03 rope: apply_rope", 0, 1),
           "ex04 softmax over the queries": ("ex04 gqa: eager_attention", 0, 0)}


@pytest.mark.parametrize("mistake", PLANTED)
def test_the_culprit_among_right_pieces_is_named_with_its_layer_and_position(references, tmp_path, mistake):
    file, _, text = WRONG[mistake]
    report = assemble(tiny_model("llama_gqa", "eager"), PROMPT, GREEDY, set(),
                      otherwise_reference(references, tmp_path, file, text))
    label, layer, position = PLANTED[mistake]
    assert sum(p.yours for p in report.pieces) == 12 and not report.equal
    culprit = report.culprit
    assert culprit.label == label and 1 <= culprit.runs <= 4  # bisected: ceil(log2(12)) runs at most
    assert (culprit.where.kind, culprit.where.pass_index, culprit.where.layer, culprit.where.position) == \
        ("layer", 0, layer, position)
    assert [p.exercise for p in culprit.before] == [p.exercise for p in report.pieces if p.yours][:len(culprit.before)]
    lines = report_lines(report, str, "x")
    assert f"The culprit: {label}." in "\n".join(lines)
    assert f"where it first differs: the output of layer {layer} (of 2) first differs at position {position} " \
           "(the prefill)" in "\n".join(lines)
    assert lines[-1].endswith(f"answer: {label} (layer {layer}, position {position}, the prefill).")


def test_the_first_of_two_wrong_pieces_is_named(references, tmp_path):
    folder = otherwise_reference(references, tmp_path, WRONG["ex08 the next token id"][0],
                                 WRONG["ex08 the next token id"][2])
    write(folder, {WRONG["ex06 logits reversed"][0]: WRONG["ex06 logits reversed"][2]})
    report = assemble(tiny_model("llama_gqa", "eager"), PROMPT, GREEDY, set(), folder)
    assert report.culprit.label == "ex06 prefill: prefill"
    assert report.culprit.where.kind == "logits" and report.culprit.where.pass_index == 0


def test_a_wrong_sampler_is_named_by_the_token_it_picks(references, tmp_path):
    folder = otherwise_reference(references, tmp_path, WRONG["ex08 the next token id"][0],
                                 WRONG["ex08 the next token id"][2])
    report = assemble(tiny_model("llama_gqa", "eager"), PROMPT, GREEDY, set(), folder)
    assert report.culprit.label == "ex08 sampling: sample"
    assert (report.culprit.where.kind, report.culprit.where.token) == ("token", 0)
    assert "every layer's output and the logits agree; the token picked first differs at token 0 (minillm's: " \
           in "\n".join(report_lines(report, str, "x"))


def test_a_wrong_filter_changes_a_seeded_sample(tmp_path):
    folder = write(tmp_path, {"ex08_sampling.py": """\
        def filter_logits(logits, params):
            return logits * 0
        """})
    params = SamplingParams(temperature=1.0, top_k=3, seed=0, max_new_tokens=6)
    assert assemble(tiny_model("llama_gqa", "eager"), PROMPT, params, set(), tmp_path / "none").equal  # seeded: same draws
    report = assemble(tiny_model("llama_gqa", "eager"), PROMPT, params, set(), folder)
    assert [p.status for p in report.pieces if p.name == "filter_logits"] == ["yours"] and not report.tokens_equal


def test_the_swap_is_undone(references):
    from minillm import model as model_module
    from minillm import phases

    before = (model_module.causal_mask, model_module.eager_attention, phases.prefill)
    model = tiny_model("llama_gqa", "eager")
    rope_class = type(model.rope)
    assemble(model, PROMPT, GREEDY, set(), write(references.parent / "rope", {"ex03_rope.py": WRONG[
        "ex03 sin negated"][2]}))
    assert (model_module.causal_mask, model_module.eager_attention, phases.prefill) == before
    assert type(model.rope) is rope_class


def test_the_speed_layer_is_refused(references):
    model = tiny_model("llama_gqa", "sdpa")
    with pytest.raises(ValueError, match="eager attention"):
        assemble(model, PROMPT, GREEDY, set(), references)


# -- the real default model, through the command line ----------------------------------------------


@pytest.mark.cli
def test_the_references_answer_paris_on_the_default_model(references, smollm2_dir):
    r = minillm("generate", "--student-dir", str(references), "--max-new-tokens", "8")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "yours:   'The capital of France is Paris.'" in r.stdout
    assert "tokens: identical (8 of 8)" in r.stdout and "prefill logits: max |diff| 0 " in r.stdout
    assert "Your engine equals minillm's" in r.stdout


@pytest.mark.cli
def test_a_rope_sign_flip_is_named_on_the_default_model(references, tmp_path, smollm2_dir):
    folder = otherwise_reference(references, tmp_path, "ex03_rope.py", SIGN_FLIP)
    r = minillm("generate", "--student-dir", str(folder), "--max-new-tokens", "3")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "ex03      apply_rope               yours" in r.stdout
    assert "Your engine differs from minillm's" in r.stdout and "the logits differ beyond the tolerance" in r.stdout
    assert "The culprit: ex03 rope: apply_rope." in r.stdout
    assert re.search(r"where it first differs: the output of layer 0 \(of 30\) first differs at position 1 "
                     r"\(the prefill\)", r.stdout), r.stdout


@pytest.mark.cli
def test_generate_stops_a_looping_piece_with_one_line_and_exit_1(tmp_path, smollm2_dir):
    folder = write(tmp_path, {"ex01_causal_mask.py": LOOP})
    r = minillm("generate", "--student-dir", str(folder), "--max-new-tokens", "2", "--timeout", "2")
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.startswith("prompt: 'What is the capital of France?'\n")  # said before the runs
    assert re.fullmatch(r"minillm: ex01's causal_mask \(ex01_causal_mask\.py, line [23]\) ran over 2 s and was "
                        r"stopped \(an endless loop\?\); --timeout SECONDS sets the limit", r.stderr.strip()), r.stderr


@pytest.mark.parametrize("flags, message", [
    (["--trace"], "--trace does not go with --student-dir"),
    (["--dtype", "bfloat16"], "--student-dir compares float32 logits"),
    (["--temperature", "0.7"], "needs --seed"),
])
def test_incompatible_flags_are_refused_in_one_line(run_main, references, flags, message):
    """In this process (conftest's run_main): refused before the model loads or a piece is imported."""
    r = run_main("generate", "--student-dir", str(references), *flags)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


# -- minillm check's engine run: in the checks' sandbox ----------------------------------------------

SUFFIX = uuid.uuid4().hex[:8]
PWNED = Path.home() / f"pwned-engine-{SUFFIX}"  # what the hostile piece tries to write in the teacher's home
WALLED = pytest.mark.skipif(not sandbox.isolation().namespaces,
                            reason="no namespaces here: the homes and the class folder are not hidden")
# an ex01 that passes (minillm's mask) but, when the engine calls it, writes to the teacher's home and
# reads the student beside it; it prints what it could do, so the report shows it
SNOOPING_MASK = """\
    import os
    from minillm.model import causal_mask as minillms

    def causal_mask(n_queries, n_keys, device=None, window=None):
        for what, act in (("write", lambda: open({pwned!r}, "w").write("pwned")),
                          ("read", lambda: open({secret!r}).read())):
            try:
                print(f"engine-wall: {{what}} got {{act()!r}} as uid {{os.getuid()}}")
            except OSError as e:
                print(f"engine-wall: {{what}} refused: {{type(e).__name__}}")
        return minillms(n_queries, n_keys, device, window)
    """


def check_engine(folder):
    """minillm check's end (cli/check.py), as after a full check whose core exercises all passed."""
    from minillm.cli.check import _assembled_engine

    console = Console(file=io.StringIO(), width=200)
    ok = _assembled_engine(console, [SimpleNamespace(id=ex, status="passed") for ex in CORE_EXERCISES], folder)
    return ok, console.file.getvalue()


@pytest.mark.large
def test_check_runs_the_references_engine_in_the_sandbox(references, smollm2_dir):
    ok, out = check_engine(references)
    assert ok, out
    assert f"pieces from {references}" in out and "minillm-sandbox-" not in out  # the scratch copy's path put back
    assert "yours:   'The capital of France is Paris.'" in out and "Your engine equals minillm's" in out
    assert "(assembled engine, in the sandbox: " in out


@pytest.mark.large
def test_check_shows_the_culprit_found_in_the_sandbox(references, tmp_path, smollm2_dir):
    ok, out = check_engine(otherwise_reference(references, tmp_path, "ex03_rope.py", SIGN_FLIP))
    assert not ok and "The culprit: ex03 rope: apply_rope." in out, out
    assert "Your engine differs from minillm's" in out


@pytest.mark.large
@WALLED
def test_check_engine_run_cannot_touch_the_teachers_home_or_another_student(references, tmp_path, smollm2_dir):
    secret = write(tmp_path / "class" / "bob", {"notes.txt": "bob's secret"}) / "notes.txt"
    folder = otherwise_reference(references, tmp_path / "class" / "mallory", "ex01_causal_mask.py",
                                 SNOOPING_MASK.format(pwned=str(PWNED), secret=str(secret)))
    try:
        ok, out = check_engine(folder)
        assert not PWNED.exists()
    finally:
        PWNED.unlink(missing_ok=True)
    assert "engine-wall: write refused: " in out and "engine-wall: read refused: " in out, out  # the piece ran
    assert "bob's secret" not in out and "engine-wall: write got" not in out
    assert ok and "Your engine equals minillm's" in out  # its mask is minillm's: the walls, not a failure, stopped it
