"""Weight-only quantisation (minillm/quantize.py): the formats' error bounds, hand-computed codes,
the fast kernels (minillm/fast/products.py's FastQuantizedLinear) against the reference path, the
bytes against the formula, and bad input.

Oracles: the rounding bound |w - ŵ| <= scale/2 of each format, small cases worked by hand, the
float model's logits, and the byte formula written out here from the format's definition.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import CONFIGS, build_hf, save_hf

from minillm import KVCache, decode_step, load_model, prefill
from minillm.costs import decode_cost, with_weights_bytes
from minillm.fast import kernels as matvec_kernels
from minillm.fast.products import FastQuantizedLinear
from minillm.quantize import (
    QuantizationError,
    QuantizedLinear,
    dequantize_int4,
    dequantize_int8,
    pack_int4,
    quantize_int4,
    quantize_int8,
    quantize_model,
    unpack_int4,
)

EPS = 1e-6  # float32 rounding of w / scale


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """Tiny random Llamas: untied (GQA) and tied (MQA), d_model 64, d_mlp 128."""
    root = tmp_path_factory.mktemp("quant")
    return {name: save_hf(build_hf(*CONFIGS[name]), root / name) for name in ("llama_gqa", "llama_mqa_tied")}


def test_int8_codes_by_hand():
    w = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]])
    q, scale = quantize_int8(w)
    assert scale.tolist() == pytest.approx([2 / 127, 1.0])  # an all-zero row gets scale 1, not 0
    assert q.tolist() == [[64, -127, 32], [0, 0, 0]]  # 63.5 rounds to even, 31.75 to 32


@pytest.mark.parametrize("shape", [(5, 40), (3, 576)])
def test_int8_round_trip_within_half_a_step(shape):
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.rand(shape[0], 1) * 3
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    error = (w - dequantize_int8(q, scale)).abs()
    assert (error <= scale[:, None] / 2 * (1 + EPS)).all()


def test_int4_codes_by_hand():
    # one group [-1, 0.5]: lo -1, hi 0.5, scale 0.1, zero round(10) = 10, q = round(w/0.1) + 10 = [0, 15]
    packed, scale, zero = quantize_int4(torch.tensor([[-1.0, 0.5]]), group_size=2)
    assert scale.item() == pytest.approx(0.1) and zero.item() == 10
    assert packed.tolist() == [[0 | 15 << 4]]


@pytest.mark.parametrize("values, zero, scale", [
    ([0.5, 1.5, 3.0, 0.1], 0, 3.0 / 15),  # all positive: the range starts at 0
    ([-0.5, -1.5, -3.0, -0.1], 15, 3.0 / 15),  # all negative: the range ends at 0
    ([2.0, 2.0, 2.0, 2.0], 0, 2.0 / 15),  # constant: exact (code 15)
    ([-2.0, -2.0, -2.0, -2.0], 15, 2.0 / 15),  # constant negative: exact (code 0)
    ([0.0, 0.0, 0.0, 0.0], 0, 1.0),  # all zero: scale 1, not a division by 0
])
def test_int4_zero_points(values, zero, scale):
    w = torch.tensor([values])
    packed, s, z = quantize_int4(w, group_size=4)
    assert z.item() == zero and s.item() == pytest.approx(scale)
    w_hat = dequantize_int4(packed, s, z, 4, group_size=4)
    assert (w - w_hat).abs().max() <= s.item() / 2 * (1 + EPS)
    if len(set(values)) == 1:
        torch.testing.assert_close(w_hat, w)


@pytest.mark.parametrize("in_features, group_size", [(64, 32), (128, 64), (70, 32), (33, 64)])
def test_int4_round_trip_within_half_a_step_including_a_short_last_group(in_features, group_size):
    torch.manual_seed(in_features)
    w = torch.randn(6, in_features) + 0.3
    packed, scale, zero = quantize_int4(w, group_size)
    n_groups = -(-in_features // group_size)
    assert packed.shape == (6, -(-in_features // 2)) and scale.shape == zero.shape == (6, n_groups)
    assert zero.max() <= 15
    w_hat = dequantize_int4(packed, scale, zero, in_features, group_size)
    step = scale.repeat_interleave(group_size, dim=1)[:, :in_features]  # each weight's own group's scale
    assert ((w - w_hat).abs() <= step / 2 * (1 + EPS)).all()
    last = w[:, (n_groups - 1) * group_size:]  # the short group's scale comes from its own values
    expected = (last.amax(1).clamp(min=0) - last.amin(1).clamp(max=0)) / 15
    torch.testing.assert_close(scale[:, -1], expected)


def test_pack_puts_the_earlier_element_in_the_low_nibble_and_round_trips():
    assert pack_int4(torch.tensor([[1, 2, 15]], dtype=torch.uint8)).tolist() == [[0x21, 0x0F]]
    q = torch.randint(0, 16, (3, 7), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack_int4(pack_int4(q), 7), q)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_fast_kernels_give_the_reference_logits(tiny_dirs, fmt, monkeypatch):
    """A decode step (1 row: the C kernels, fast=True) against the same model on the plain modules,
    which dequantise explicitly (fast=False)."""
    calls = []
    for name in ("quantized_matvec", "quantized_amx_unchecked"):  # (the second where the CPU has AMX-INT8)
        kernel = getattr(matvec_kernels, name)
        monkeypatch.setattr(matvec_kernels, name, lambda *a, _f=kernel: calls.append(1) or _f(*a))
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    logits = {}
    for fast in (True, False):
        model = load_model(tiny_dirs["llama_gqa"], device="cpu", quantize=fmt, fast=fast)
        assert any(type(m) is FastQuantizedLinear for m in model.modules()) == fast
        cache, before = KVCache.for_model(model, max_seq_len=8), len(calls)
        prefill(model, ids, cache)
        logits[fast] = decode_step(model, torch.tensor([7]), cache)
        assert (len(calls) > before) == fast  # the C kernel ran on the fast modules only
    error = (logits[True] - logits[False]).abs().max() / logits[False].abs().max()
    assert error <= 1e-4


@pytest.mark.compile
def test_compiled_decode_step_calls_the_kernels_as_ops(tiny_dirs):
    """The "compile" decode path on an int4 model: dynamo cannot trace ctypes, so the kernels are
    torch custom ops; the compiled step's logits equal the plain modules' eager step's (one compile, seconds)."""
    from minillm.fast.compile import compile_decode_step

    model = load_model(tiny_dirs["llama_gqa"], device="cpu", quantize="int4")
    pure = load_model(tiny_dirs["llama_gqa"], device="cpu", quantize="int4", fast=False)
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    eager, static = (KVCache.for_model(model, max_seq_len=12) for _ in range(2))
    a, b = prefill(pure, ids, eager).argmax(-1), prefill(model, ids, static).argmax(-1)
    step = compile_decode_step("default")
    for _ in range(3):
        la, lb = decode_step(pure, a, eager), step(model, b, static)
        assert (la - lb).abs().max() <= 1e-4 * la.abs().max()
        a, b = la.argmax(-1), lb.argmax(-1)


@pytest.mark.parametrize("fmt, out_features, in_features, group_size", [
    ("int8", 5, 37, None), ("int8", 576, 576, None), ("int4", 7, 128, 64), ("int4", 33, 96, 32), ("int4", 3, 48, 16)])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_c_kernel_equals_dequantise_then_linear(fmt, out_features, in_features, group_size, rows):
    """The C kernel against F.linear on the explicitly dequantised matrix: odd sizes, several rows."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(out_features, in_features, generator=g)
    x = torch.randn(rows, in_features, generator=g)
    layer = FastQuantizedLinear(w, None, fmt, **({"group_size": group_size} if group_size else {}))
    assert layer._kernels_apply(x)
    fast, reference = layer._product(x), layer.forward_reference(x)
    assert (fast - reference).abs().max() <= 1e-5 * reference.abs().max()
    assert torch.equal(layer(x), fast)  # (at most QUANTIZED_TILED_MAX_ROWS rows: the products in C)
    assert (layer._unpacked() - layer.dequantize()).abs().max() <= 1e-6 * layer.dequantize().abs().max()


def test_portable_c_loops_equal_the_reference():
    """The kernels built without -march=native (no AVX2 branch: what another CPU compiles) agree too."""
    lib = matvec_kernels.kernels(portable=True)
    assert lib is not None
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(40, 192, generator=g), torch.randn(2, 192, generator=g)
    for fmt in ("int8", "int4"):
        layer = QuantizedLinear(w, None, fmt)
        codes = (layer.qweight, layer.scale, layer.zero, layer.group_size)
        y = matvec_kernels.quantized_matvec(x, *codes, lib=lib)
        reference = layer.forward_reference(x)
        assert (y - reference).abs().max() <= 1e-5 * reference.abs().max()
        unpacked = matvec_kernels.dequantize(*codes, lib=lib)
        assert (unpacked - layer.dequantize()).abs().max() <= 1e-6 * unpacked.abs().max()


def test_no_c_compiler_falls_back_to_the_reference_path_and_says_why(monkeypatch):
    monkeypatch.setattr(matvec_kernels, "_state", {})
    monkeypatch.setenv("CC", "no-such-compiler-minillm")
    layer = FastQuantizedLinear(torch.randn(4, 64), None, "int4")
    x = torch.randn(1, 64)
    with pytest.warns(RuntimeWarning, match="no C compiler 'no-such-compiler-minillm'.*reference path"):
        y = layer(x)
    assert matvec_kernels.unavailable_reason() == "no C compiler 'no-such-compiler-minillm' on PATH"
    assert torch.equal(y, layer.forward_reference(x))


@pytest.mark.parametrize("fmt, bound", [("int8", 0.02), ("int4", 0.3)])
def test_quantised_logits_stay_near_the_float_model(tiny_dirs, fmt, bound):
    """Max |logit difference| relative to max |logit|: measured 0.008 (int8) and 0.126 (int4); bounds ~2.5x."""
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38]])
    reference = load_model(tiny_dirs["llama_mqa_tied"], device="cpu")(ids)
    quantised = load_model(tiny_dirs["llama_mqa_tied"], device="cpu", quantize=fmt)(ids)  # 10 rows: reference path
    error = (quantised - reference).abs().max() / reference.abs().max()
    assert 0 < error <= bound


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("name", ["qwen2", "gpt2"])
def test_projections_sharing_an_input_are_one_stacked_matrix_with_their_own_codes(tmp_path, name, fmt):
    """quantize_model quantises each projection on its own; the speed layer stacks q|k|v (and gate|up)
    into one matrix whose rows are the members' own codes, scales, zeros and biases, each member now
    a view of its rows (per-row int8 and per-row-group int4 scales: stacking changes no code). The
    oracle: each float projection quantised alone. The decode step's logits stay the plain modules'."""
    folder = save_hf(build_hf(*CONFIGS[name]), tmp_path / name)
    float_model, model = load_model(folder, device="cpu", fast=False), load_model(folder, device="cpu", quantize=fmt)
    quantize = quantize_int8 if fmt == "int8" else quantize_int4
    stacks = {"qkv": ("attn", ("q_proj", "k_proj", "v_proj"))}
    if name == "qwen2":
        stacks["gate_up"] = ("mlp", ("gate_proj", "up_proj"))
    for float_block, block in zip(float_model.blocks, model.blocks):
        for stacked, (part, names) in stacks.items():
            matrix, start = getattr(getattr(block, part), stacked).module, 0
            assert type(matrix) is FastQuantizedLinear
            for proj in names:
                linear, member = getattr(getattr(float_block, part), proj), getattr(getattr(block, part), proj)
                rows = slice(start, start + linear.out_features)
                codes = quantize(linear.weight)
                for buffer, own, expected in zip((matrix.qweight, matrix.scale, matrix.zero),
                                                 (member.qweight, member.scale, member.zero), codes):
                    assert torch.equal(buffer[rows], expected) and torch.equal(own, expected)
                    assert own.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # a view
                if linear.bias is not None:
                    assert torch.equal(matrix.bias[rows], linear.bias) and torch.equal(member.bias, linear.bias)
                start += linear.out_features
            assert start == matrix.out_features
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    logits = []
    for m in (model, load_model(folder, device="cpu", quantize=fmt, fast=False)):
        cache = KVCache.for_model(m, max_seq_len=8)
        prefill(m, ids, cache)
        logits.append(decode_step(m, torch.tensor([7]), cache))
    fast, reference = logits
    assert (fast - reference).abs().max() <= 1e-4 * reference.abs().max()


def _int8_bytes(out, n_in):
    return out * n_in + 4 * out  # int8 codes + a float32 scale per row


def _int4_bytes(out, n_in, group=64):
    return out * ((n_in + 1) // 2) + out * ((n_in + group - 1) // group) * (4 + 1)  # nibbles + scale, zero


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("name", ["llama_gqa", "llama_mqa_tied"])
@pytest.mark.parametrize("fmt, matrix_bytes", [("int8", _int8_bytes), ("int4", _int4_bytes)])
def test_weights_bytes_equal_the_formula(tiny_dirs, name, fmt, matrix_bytes, fast):
    """The stacked q|k|v and gate|up of the fast modules are the members' bytes, counted once."""
    model = load_model(tiny_dirs[name], device="cpu", quantize=fmt, fast=fast)
    c = model.config
    kv = c.n_kv_heads * c.head_dim
    layer = (matrix_bytes(c.d_model, c.d_model) + 2 * matrix_bytes(kv, c.d_model) + matrix_bytes(c.d_model, c.d_model)
             + 2 * matrix_bytes(c.d_mlp, c.d_model) + matrix_bytes(c.d_model, c.d_mlp) + 2 * c.d_model * 4)  # norms
    head = matrix_bytes(c.vocab_size, c.d_model)
    embed = 0 if c.tie_word_embeddings else c.vocab_size * c.d_model * 4  # tied: the head's copy is what is read
    expected = c.n_layers * layer + c.d_model * 4 + head + embed
    assert model.weights_bytes() == expected
    cost = with_weights_bytes(decode_cost(c, 10, 4), model.weights_bytes())
    assert cost.weights_bytes == expected  # the roofline floor moves with the bytes


def test_bad_input_is_one_line(tiny_dirs):
    with pytest.raises(QuantizationError, match="quantize must be one of int8, int4, got 'int3'"):
        load_model("/no/such/model", quantize="int3")  # refused before looking for the model
    with pytest.raises(QuantizationError, match="needs dtype float32 on cpu"):
        load_model(tiny_dirs["llama_gqa"], device="cpu", dtype="float16", quantize="int8")
    model = load_model(tiny_dirs["llama_gqa"], device="cpu", quantize="int8")
    with pytest.raises(QuantizationError, match="already quantised"):
        quantize_model(model, "int4")
    with pytest.raises(QuantizationError, match="group_size must be >= 2"):
        quantize_int4(torch.ones(2, 4), group_size=1)
    bf16 = load_model(tiny_dirs["llama_gqa"], device="cpu", dtype="bfloat16")
    with pytest.raises(QuantizationError, match="needs float32 weights on cpu"):
        quantize_model(bf16, "int8")


def test_info_counts_the_quantised_bytes_and_names_the_float_embedding(tiny_dirs, capsys):
    from minillm.cli import main

    folder = tiny_dirs["llama_mqa_tied"]
    assert main(["info", "--model", str(folder), "--quantize", "int4"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    expected = load_model(folder, device="cpu", quantize="int4").weights_bytes()
    assert f"weights bytes │ {expected:,}" in out
    assert f"{folder} (float32, int4 weights)" in out  # the title (was "(float32)")
    assert "│ quantization │ int4 matrices, float embedding │" in out
    assert "│ + float embedding │ 32.0 KiB (lookup only) │" in out  # 128 x 64 float32, memory not read per step


def test_cli_refuses_an_unknown_format(tiny_dirs, capsys):
    from minillm.cli import main

    assert main(["generate", "hi", "--model", str(tiny_dirs["llama_gqa"]), "--quantize", "int3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--quantize: invalid choice: 'int3'" in err


# -- what a fresh user's trial found (each a defect once) --------------------------------------


def test_parameters_count_the_weights_whatever_the_format(tiny_dirs):
    """num_parameters counted only float parameters: `minillm info --quantize int4` said 28 M for SmolLM2's 135 M."""
    for name in ("llama_gqa", "llama_mqa_tied"):
        float_count = load_model(tiny_dirs[name], device="cpu", fast=False).num_parameters()
        for fmt in ("int8", "int4"):
            for fast in (False, True):
                model = load_model(tiny_dirs[name], device="cpu", quantize=fmt, fast=fast)
                assert model.num_parameters() == float_count


def test_reference_path_takes_float64_input_with_a_bias():
    layer = QuantizedLinear(torch.randn(7, 64), torch.randn(7), "int8")
    x = torch.randn(2, 64, dtype=torch.float64)
    y = layer(x)  # was: "self and mat2 must have the same dtype" (a float32 bias)
    assert y.dtype == torch.float64
    assert torch.allclose(y, x @ layer.dequantize().double().T + layer.bias.double())


def test_a_compiler_named_with_flags_builds(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "cc -w")  # was: "no C compiler 'cc -w' on PATH"
    lib, why = matvec_kernels._build(flag_sets=(["-O2"],), cache_dir=tmp_path)
    assert lib is not None, why


def test_kernels_that_cannot_be_loaded_fall_back_with_the_reason(monkeypatch, tmp_path):
    """A TMPDIR mounted noexec: the build succeeds, loading fails (was: the command died)."""
    def refuse(path):
        raise OSError(f"{path}: failed to map segment from shared object")

    monkeypatch.setattr(matvec_kernels.ctypes, "CDLL", refuse)
    lib, why = matvec_kernels._build(flag_sets=(["-O2"],), cache_dir=tmp_path)
    assert lib is None and "could not load" in why and "TMPDIR" in why


def test_the_cli_prints_minillm_warnings_on_one_line(capsys):
    from minillm.cli import command

    command._show_warning(RuntimeWarning("the kernels are away"), RuntimeWarning, matvec_kernels.__file__, 48)
    assert capsys.readouterr().err == "minillm: warning: the kernels are away\n"


@pytest.mark.parametrize("fast", [True, False])
def test_the_draft_model_is_quantised_like_the_target(tiny_dirs, fast):
    """--quantize applied to the target only; `--draft-model` ran in float32. (--no-fast reaches it too.)"""
    import argparse

    from minillm.cli.generate import _speculative_config

    args = argparse.Namespace(speculative="draft_model", draft_model=str(tiny_dirs["llama_gqa"]), weights_dir=None,
                              device="cpu", dtype=None, quantize="int4", num_speculative_tokens=3,
                              prompt_lookup_min=None, prompt_lookup_max=None, fast=fast)
    draft = _speculative_config(args).draft_model
    assert draft.quantization == "int4" and (draft.decode_path is not None) == fast


def test_the_peak_memory_child_loads_the_same_quantisation(tiny_dirs, monkeypatch):
    """`minillm bench --quantize int8` measured the float model's memory in its child process."""
    from minillm.bench import memory

    seen = {}

    def run(cmd, **kwargs):
        seen["code"] = cmd[-1]
        raise SystemExit  # the command is what this test reads

    monkeypatch.setattr(memory.subprocess, "run", run)
    with pytest.raises(SystemExit):
        memory.measure_peak_memory(load_model(tiny_dirs["llama_gqa"], device="cpu", quantize="int8"))
    assert "'quantize': 'int8'" in seen["code"]
