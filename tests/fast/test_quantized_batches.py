"""A batch of rows through a quantised matrix: the tiled C kernel (quantized_matmul) and, in a server, the
panel kernel (quantized_panel_matmul) that a serving step's decodes run, against the reference path
(dequantise the whole matrix, then F.linear); and every quantised kernel (quantized_matvec and dequantize
too) on the native build and the portable one.

The oracle is ``QuantizedLinear.forward_reference``; the kernels use the same dequantised values and
only sum in another order, so they agree within float32 rounding. The engine test runs 20 requests at
once (decode steps of 20 rows: the tiled kernel) and compares every greedy token with the same engine
run on the plain quantised modules (fast=False).
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import CONFIGS, build_hf, save_hf

from minillm import LLMEngine, SamplingParams, load_model
from minillm.fast import kernels
from minillm.fast.packing import pack_panels
from minillm.fast.products import QUANTIZED_MATVEC_MAX_ROWS, QUANTIZED_TILED_MAX_ROWS, FastQuantizedLinear
from minillm.quantize import QuantizedLinear

# (format, out_features, in_features, group_size): odd sizes, a last tile that is not whole, int4 groups of
# 16 (two groups in one 32-weight vector), 32 and 64, and a K that is no multiple of any vector width
SHAPES = [("int8", 7, 37, None), ("int8", 50, 577, None), ("int8", 29, 1536, None), ("int4", 13, 48, 16),
          ("int4", 33, 96, 32), ("int4", 61, 576, 64)]


def close(got: torch.Tensor, reference: torch.Tensor) -> bool:
    """Equal within float32 rounding of sums of a few hundred products."""
    return bool((got - reference).abs().max() <= 1e-5 * reference.abs().max())


@pytest.mark.parametrize("fmt, out_features, in_features, group_size", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_every_row_count_equals_dequantise_then_linear(fmt, out_features, in_features, group_size, bias):
    """Rows 1..40 (the fused kernel, the tiled one with every remainder of its 4-row blocks), with and
    without a bias, through FastQuantizedLinear's forward."""
    g = torch.Generator().manual_seed(out_features)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    layer = FastQuantizedLinear(w, b, fmt, **({"group_size": group_size} if group_size else {}))
    for rows in range(1, 41):
        x = torch.randn(rows, in_features, generator=g)
        assert layer._kernels_apply(x)
        got, reference = layer(x), layer.forward_reference(x)
        assert close(got, reference), f"{rows} rows: max error {(got - reference).abs().max():.3g}"


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("amx", [False, True], ids=["no-amx", "amx"])
def test_the_forward_picks_the_kernel_by_rows(fmt, amx, monkeypatch):
    """Up to QUANTIZED_MATVEC_MAX_ROWS rows the fused kernel, up to QUANTIZED_TILED_MAX_ROWS the tiled
    one, more the unpacked float matrix; int8 on a CPU with AMX-INT8 the matrix units at every row count."""
    if amx and not kernels.quantized_amx_ready():
        pytest.skip("this CPU (or build) has no AMX-INT8")
    if not amx:
        monkeypatch.setattr(kernels, "quantized_amx_ready", lambda: False)
    calls = []
    for name in ("quantized_matvec", "quantized_matmul", "dequantize", "quantized_amx_unchecked"):
        original = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _name=name, _f=original, **k: calls.append(_name) or _f(*a, **k))
    layer = FastQuantizedLinear(torch.randn(16, 64), None, fmt)
    counts = (1, QUANTIZED_MATVEC_MAX_ROWS, QUANTIZED_MATVEC_MAX_ROWS + 1, 20, QUANTIZED_TILED_MAX_ROWS,
              QUANTIZED_TILED_MAX_ROWS + 1)
    expected = {}
    for rows in counts:
        calls.clear()
        layer(torch.randn(rows, 64))
        expected[rows] = calls[:]
    matvec, matmul, unpack = ["quantized_matvec"], ["quantized_matmul"], ["dequantize"]
    if amx:
        assert expected == {rows: ["quantized_amx_unchecked"] for rows in counts}
    else:
        assert expected == {1: matvec, QUANTIZED_MATVEC_MAX_ROWS: matvec, QUANTIZED_MATVEC_MAX_ROWS + 1: matmul,
                            20: matmul, QUANTIZED_TILED_MAX_ROWS: matmul, QUANTIZED_TILED_MAX_ROWS + 1: unpack}


BUILDS = pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])


@BUILDS
def test_quantised_kernels_of_each_build_equal_the_reference(portable):
    """Built without -march=native (the portable branches another CPU compiles: 4-float vectors, scalar
    int4 unpacking) and with it (AVX2 or AVX-512 here): the fused kernel (1-3 rows), the tiled one (several
    thread counts split the tiles) and the unpacked matrix, every shape."""
    lib = kernels.kernels(portable)
    g = torch.Generator().manual_seed(1)
    for fmt, out_features, in_features, group_size in SHAPES:
        layer = QuantizedLinear(torch.randn(out_features, in_features, generator=g), None, fmt, group_size or 64)
        codes = (layer.qweight, layer.scale, layer.zero, layer.group_size)
        w = kernels.dequantize(*codes, lib=lib)
        assert (w - layer.dequantize()).abs().max() <= 1e-6 * layer.dequantize().abs().max()
        for rows in (1, 2, 3):
            x = torch.randn(rows, in_features, generator=g)
            assert close(kernels.quantized_matvec(x, *codes, lib=lib), layer.forward_reference(x)), (fmt, rows)
        for rows, threads in ((3, 1), (9, 2), (32, 3)):
            x = torch.randn(rows, in_features, generator=g)
            with_threads = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                got = kernels.quantized_matmul(x, *codes, lib=lib)
            finally:
                torch.set_num_threads(with_threads)
            assert close(got, layer.forward_reference(x)), (fmt, out_features, in_features, rows, threads)


def test_tiled_kernel_refuses_codes_it_would_misread():
    layer = QuantizedLinear(torch.randn(8, 64), None, "int4")
    with pytest.raises(ValueError, match="group_size must be a positive multiple of 16"):
        kernels.quantized_matmul(torch.randn(4, 64), layer.qweight, layer.scale, layer.zero, 24)
    with pytest.raises(ValueError, match=r"x must be float32 \[rows, 64\]"):
        kernels.quantized_matmul(torch.randn(4, 63), layer.qweight, layer.scale, layer.zero, 64)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_hf(build_hf(*CONFIGS["llama_gqa"]), tmp_path_factory.mktemp("quantized_batches") / "llama_gqa")


@pytest.mark.parametrize("packed", [False, True], ids=["one copy", "pack_panels"])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_batch_of_20_requests_gives_the_reference_greedy_tokens(tiny_llama, fmt, packed, monkeypatch):
    """20 requests in one engine (decode steps of 20 rows: the tiled kernel, or with pack_panels
    (``minillm serve --pack-weights``) the panel kernel where the build converts codes in vectors; int8 on
    AMX-INT8 the matrix units) on the
    quantised fast model give the greedy tokens of the same engine on the plain quantised modules
    (fast=False: dequantise, then F.linear), request by request."""
    rows_seen = []
    panels = packed and kernels.quantized_panels_vectorised()
    name = "quantized_panel_matmul" if panels else "quantized_matmul"
    if kernels.quantized_amx_ready():
        name = "quantized_amx_unchecked"  # (every row count on the matrix units)
    original = getattr(kernels, name)
    monkeypatch.setattr(kernels, name, lambda x, *a: rows_seen.append(x.shape[0]) or original(x, *a))
    prompts = [[(7 * i + j) % 120 + 3 for j in range(3 + i % 6)] for i in range(20)]
    params = SamplingParams(max_new_tokens=6)
    tokens = {}
    for fast in (True, False):
        model = load_model(tiny_llama, device="cpu", quantize=fmt, fast=fast)
        if fast and packed:
            pack_panels(model)
        engine = LLMEngine(model, num_blocks=48, block_size=16, max_num_seqs=32)
        tokens[fast] = [out.token_ids for out in engine.generate(prompts, params)]
    for i, (got, expected) in enumerate(zip(tokens[True], tokens[False])):
        assert got == expected, f"request {i}: fast {got}, reference {expected}"
    assert 20 in rows_seen  # the decode steps ran the kernel on the whole batch


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_prompt_longer_than_a_step_gives_the_reference_tokens(tiny_llama, fmt):
    """A 40-token prompt with 16 tokens a step: its first chunks ask the quantised LM head for no logits (zero
    rows), the last for one; greedy tokens as the plain quantised modules give them."""
    prompt = [(11 * j) % 120 + 3 for j in range(40)]
    tokens = {}
    for fast in (True, False):
        model = load_model(tiny_llama, device="cpu", quantize=fmt, fast=fast)
        engine = LLMEngine(model, num_blocks=16, block_size=16, max_num_batched_tokens=16)
        tokens[fast] = engine.generate([prompt], SamplingParams(max_new_tokens=5))[0].token_ids
    assert tokens[True] == tokens[False]


@BUILDS
@pytest.mark.parametrize("kernel", ["quantized_matvec", "quantized_matmul"])
def test_no_rows_give_no_rows(portable, kernel):
    layer = QuantizedLinear(torch.randn(24, 64), None, "int4")
    y = getattr(kernels, kernel)(torch.ones(0, 64), layer.qweight, layer.scale, layer.zero, 64,
                                 lib=kernels.kernels(portable))
    assert y.shape == (0, 24)


@BUILDS
def test_quantized_panels_of_each_build_equal_the_reference(portable):
    """The panel kernel (a server's batches: codes copied into panels, dequantised in registers) on
    every shape, across its row blocks and part-filled last panel, both builds."""
    lib = kernels.kernels(portable)
    g = torch.Generator().manual_seed(2)
    for fmt, out_features, in_features, group_size in SHAPES:
        layer = QuantizedLinear(torch.randn(out_features, in_features, generator=g), None, fmt, group_size or 64)
        zero = layer.zero if fmt == "int4" else None
        panels = kernels.quantized_pack_panels(layer.qweight, layer.scale, zero, group_size, lib=lib)
        for rows in (1, 4, 13, 32):
            x = torch.randn(rows, in_features, generator=g)
            got = kernels.quantized_panel_matmul(x, panels, lib=lib)
            assert close(got, layer.forward_reference(x)), f"{fmt} {out_features}x{in_features}, {rows} rows"


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_servers_layer_runs_panels_and_repacks_after_an_edit(fmt, monkeypatch):
    """With ``panels`` (set by the serving batch), 4-128 rows run the panel kernel on a copy packed
    once; an edit of the codes or the scales packs them again; 1-3 rows keep the fused kernel."""
    packs = []
    pack = kernels.quantized_pack_panels
    monkeypatch.setattr(kernels, "quantized_pack_panels", lambda *a: packs.append(1) or pack(*a))
    g = torch.Generator().manual_seed(3)
    layer = FastQuantizedLinear(torch.randn(40, 64, generator=g), None, fmt)
    layer.panels = True
    for rows in (1, QUANTIZED_MATVEC_MAX_ROWS + 1, 20, QUANTIZED_TILED_MAX_ROWS):
        x = torch.randn(rows, 64, generator=g)
        assert close(layer(x), layer.forward_reference(x))
    assert len(packs) == (1 if kernels.quantized_panels_vectorised() else 0)
    vectorised = kernels.quantized_panels_vectorised()
    for n, edit in enumerate((lambda: layer.qweight.copy_(layer.qweight.flip(0)), lambda: layer.scale.mul_(2),
                              lambda: setattr(layer, "scale", layer.scale * 3)), start=2):
        with torch.no_grad():
            edit()  # the codes or the scales, in place or replaced (was: the scales' edits kept a stale copy)
        x = torch.randn(20, 64, generator=g)
        assert close(layer(x), layer.forward_reference(x))
        assert len(packs) == (n if vectorised else 0)


def test_codes_on_another_device_are_refused_not_read():
    """Was: scales on the meta device crashed the process (the C loop read their null pointer)."""
    layer = QuantizedLinear(torch.randn(40, 64), None, "int4", 32)
    for args in ((layer.qweight, layer.scale.to("meta"), layer.zero, 32), (layer.qweight, layer.scale, layer.zero.to("meta"), 32)):
        with pytest.raises(ValueError, match="the C kernels read CPU tensors"):
            kernels.quantized_pack_panels(*args)
    with pytest.raises(ValueError, match="group_size must be an int"):
        kernels.quantized_pack_panels(layer.qweight, layer.scale, layer.zero, 32.0)
    with pytest.raises(ValueError, match="f32_matvec takes float32 CPU tensors"):
        kernels.f32_matvec(torch.randn(2, 64), torch.randn(40, 64, device="meta"))


@BUILDS
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_weights_that_are_all_zero_give_zero_in_the_matvec(portable, rows):
    """Every code equal to its zero point (each weight 0) in one group of 131,072, x positive: the answer is 0.
    quantized_matvec took zero · Σx out of the group's float sum and gave 187.8 at 2 rows (a new user's trial);
    it now forms q - zero in integers first."""
    lib = kernels.kernels(portable)
    layer = QuantizedLinear(torch.zeros(2, 131072), None, "int4", 131072)
    layer.qweight.fill_(255)  # every code 15
    layer.zero.fill_(15)
    layer.scale.fill_(0.1)
    x = torch.full((rows, 131072), 1.5 + 2.0 ** -10)
    x[:, 0] = 127.0
    y = kernels.quantized_matvec(x, layer.qweight, layer.scale, layer.zero, 131072, lib=lib)
    assert torch.equal(y, torch.zeros(rows, 2))
