"""minillm calibrate and whatif: this machine's roofline, and predicted TTFT / TPOT on any hardware."""

from __future__ import annotations

import math
import sys

from ..formats import weights
from ..units import fmt_bytes, fmt_num
from .common import UsageError, busy_note_now, ensure_model, warn


def add_calibrate(sub) -> None:
    p = sub.add_parser("calibrate", help="measure this machine's peak matmul FLOP/s and memory bandwidth")
    p.add_argument("--device", default="cpu", help="cpu, cuda or mps (default: cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="the dtype of the measured matmuls")
    p.add_argument("--quick", action="store_true", help="smaller, faster measurement (less accurate)")
    p.add_argument("--decode-path", action="store_true",
                   help="also measure each decode path of --model on the cpu in --dtype, float32 or bfloat16, or "
                        "--quantize's format (layout, split product, torch.compile: a minute or more) and keep the "
                        "fastest (minillm/fast/choose.py)")
    p.add_argument("--quantize", choices=["int8", "int4"],
                   help="the decode path shown or measured is the one of --model quantised to this format "
                        "(default: none, its weights as --dtype)")
    p.add_argument("--model", "-m", default=weights.DEFAULT_MODEL,
                   help=f"the model whose decode path is shown or measured (default: {weights.DEFAULT_MODEL})")
    p.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    p.set_defaults(run=run_calibrate)


def run_calibrate(args) -> int:
    from rich.console import Console

    from ..hardware import calibrate, calibration_path

    if args.decode_path and args.quantize and args.dtype != "float32":
        raise UsageError(f"--quantize {args.quantize}'s models compute in float32, got --dtype {args.dtype}; "
                         "drop --dtype to measure their decode paths")
    if args.decode_path and args.dtype not in ("float32", "bfloat16"):
        raise UsageError(f"--decode-path measures float32 or bfloat16 decode paths, got --dtype {args.dtype}; "
                         "pass --dtype float32 or --dtype bfloat16")
    hw = calibrate(args.device, args.dtype, quick=args.quick)
    console = Console()
    console.print(_hardware_table(hw, f"calibrated {args.device} {args.dtype} (saved to {calibration_path()})"))
    precision = args.quantize or (args.dtype if args.dtype in ("float32", "bfloat16") else "float32")
    console.print(f"decode path of {args.model} on cpu {precision}: {_decode_path(args, precision, console)}")
    if args.device == "cpu" and (busy := busy_note_now()) is not None:  # the peaks and timings above are the share the run got, not the machine's
        warn(f"{busy}: other processes took CPU time from these measurements; calibrate again on a quiet machine")
    return 0


def _decode_path(args, precision: str, console) -> str:
    """The cached (or, with --decode-path, measured now) decode path of --model in ``precision`` (a dtype or a
    quantised format), as one line."""
    from ..config import ModelConfig
    from ..fast.choose import CANDIDATES, calibrate_decode_path, load_decode_choice
    from ..loading import load_model

    if not args.decode_path:
        if weights.is_model_name(args.model) and not weights.is_downloaded(args.model):
            return "not measured yet (the model is not downloaded)"  # showing it is no reason to fetch it
        choice = load_decode_choice(ModelConfig.from_json(weights.resolve_model(args.model)), precision)
        if choice is None:
            return "not measured (chosen by rule at load; --decode-path measures them all)"
    else:
        quantized = precision in ("int8", "int4")
        model = load_model(ensure_model(args.model, None), device="cpu", dtype="float32" if quantized else precision,
                           quantize=precision if quantized else None)
        with console.status("measuring decode paths") as status:
            choice = calibrate_decode_path(model, progress=lambda line: status.update(f"measuring {line}"))
    if not CANDIDATES[choice.name].compiled:
        return str(choice)
    eager = [n for n in choice.timings_ms if not CANDIDATES[n].compiled] or ["replay"]
    return (f"{choice}\n(a compiled path: every process compiles its first decode step, a minute or more cold; "
            f"for one-shot commands MINILLM_DECODE_PATH={min(eager, key=choice.timings_ms.get)} runs the fastest "
            "eager path)")


def _hardware_table(hw, title: str):
    from rich.table import Table

    table = Table(title=title, show_header=False)
    table.add_row("device", hw.name)
    table.add_row("peak matmul", f"{hw.peak_flops / 1e9:,.1f} GFLOP/s")
    table.add_row("memory bandwidth", f"{hw.mem_bandwidth / 1e9:,.1f} GB/s")
    table.add_row("ridge point", f"{hw.ridge_point:,.1f} FLOP/byte")
    table.add_row("how", hw.description)
    return table


def add_whatif(sub) -> None:
    p = sub.add_parser("whatif", help="predict TTFT and TPOT of a model on some hardware (roofline floors)")
    p.add_argument("--model", "-m", "--config", dest="config", required=True,
                   help="config.json path or folder, a downloaded model, or a shipped example: gpt2-124m, "
                        "llama-2-7b, llama-3-8b, mistral-7b, qwen2.5-0.5b, qwen3-0.6b, smollm2-135m-instruct "
                        "(--config: the older spelling)")
    p.add_argument("--hardware", default="h100", help="h100, h200, a100, l4, rtx4090, m2-max, laptop-cpu, "
                                                     "or 'this' (the calibrated local machine)")
    p.add_argument("--device", help="with --hardware this: which device's calibration (default: cpu)")
    p.add_argument("--prompt-tokens", type=int, default=2000, help="tokens prefilled")
    p.add_argument("--output-tokens", type=int, default=200, help="tokens generated")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="default bfloat16; with --hardware this, the dtype the model runs in on --device "
                        "(float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--batch-size", type=int, default=1, help="requests decoded together")
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1, metavar="N",
                   help="split the model over N devices: each does 1/N of the work, then 2 all-reduces a layer "
                        "(default: 1)")
    p.add_argument("--interconnect-gb-s", type=float, metavar="GB/S",
                   help="with --tensor-parallel-size: each device's link, GB/s one direction (NVLink 4: 450, "
                        "PCIe 5 x16: 64, PCIe 4 x16: 32, 100 GbE: 12.5; default: none, required with N > 1)")
    p.add_argument("--interconnect-latency-us", type=float, default=0.0, metavar="US",
                   help="with --tensor-parallel-size: time of one ring step's message however small, µs; an "
                        "all-reduce pays it 2(N-1) times (measure a small all-reduce and divide; default 0: "
                        "bandwidth alone, a floor)")
    p.add_argument("--tier-bandwidth", nargs="+", action="extend", metavar="TIER",
                   help="load or recompute (prompt caching beyond the KV pool): the K/V bytes of the --prompt-tokens "
                        "prefix, the time to read them from each TIER against the time to prefill them again (one "
                        "device's roofline floor), which is cheaper, and the break-even bandwidth. TIER: host (a "
                        "copy in --hardware's memory: half its bandwidth, a copy reads and writes each byte), pcie4 "
                        "(32 GB/s), pcie5 (64; a GPU reads host memory over PCIe), nvme (5), sata-ssd (0.5), 10gbe "
                        "(1.25), 100gbe (12.5), a number of GB/s, or NAME=GB/S; several at once (default: none)")
    p.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    p.set_defaults(run=run_whatif)


def run_whatif(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from ..whatif import load_config, predict

    for flag, value in (("--prompt-tokens", args.prompt_tokens), ("--output-tokens", args.output_tokens),
                        ("--batch-size", args.batch_size), ("--tensor-parallel-size", args.tensor_parallel_size)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    for flag, value in (("--interconnect-gb-s", args.interconnect_gb_s),
                        ("--interconnect-latency-us", args.interconnect_latency_us)):
        if value is not None and not math.isfinite(value):  # inf GB/s would predict free all-reduces
            raise UsageError(f"{flag} must be a finite number, got {value:g}")
    tp = args.tensor_parallel_size > 1
    if tp and not (args.interconnect_gb_s or 0) > 0:
        raise UsageError("--tensor-parallel-size > 1 needs --interconnect-gb-s > 0 (NVLink 4: 450, PCIe 5 x16: 64)")
    if not tp and (args.interconnect_gb_s is not None or args.interconnect_latency_us):
        warn("--interconnect-gb-s and --interconnect-latency-us have no effect without --tensor-parallel-size > 1")
    if args.interconnect_latency_us < 0:
        raise UsageError(f"--interconnect-latency-us must be >= 0, got {args.interconnect_latency_us:g}")
    if args.device and args.hardware != "this":
        warn(f"--device has no effect with --hardware {args.hardware} (a datasheet); it picks the calibration "
             "of --hardware this")
    args.device = args.device or "cpu"
    args.dtype = args.dtype or _whatif_dtype(args.hardware, args.device)
    hw = _whatif_hardware(args.hardware, args.device, args.dtype)
    tiers = _tier_bandwidths(args.tier_bandwidth or [], hw)
    config = load_config(args.config)
    if args.prompt_tokens + args.output_tokens > config.max_seq_len:
        warn(f"{args.prompt_tokens:,} prompt + {args.output_tokens:,} output tokens exceed {args.config}'s "
             f"{config.max_seq_len:,}-token context: the model cannot run this request; the floors are extrapolated")
    dtype_bytes = 4 if args.dtype == "float32" else 2
    if tp:
        from ..distributed.tensor_parallel import check_tensor_parallel_size

        check_tensor_parallel_size(config, args.tensor_parallel_size)
    w = predict(config, hw, args.prompt_tokens, args.output_tokens, dtype_bytes, args.batch_size,
                args.tensor_parallel_size, args.interconnect_gb_s, args.interconnect_latency_us)
    devices = f" x {w.tensor_parallel_size}" if tp else ""
    table = Table(title=f"{args.config} on {hw.name}{devices}, {args.dtype}, batch {w.batch_size} (roofline floors)",
                  show_header=False)
    fits = {True: "fits", False: "does NOT fit", None: "capacity unknown"}[w.fits_in_memory]
    na = "n/a (one output token)"
    rows = [
        ("hardware", str(hw)),
        ("request", f"{w.prompt_tokens} prompt + {w.output_tokens} output tokens"),
        ("weights bytes", f"{w.weights_bytes:,} ({fmt_bytes(w.weights_bytes)})"),
        ("KV bytes per token", f"{w.kv_bytes_per_token:,} ({fmt_bytes(w.kv_bytes_per_token)})"),
        ("KV bytes per request", f"{w.kv_bytes_per_request:,} ({fmt_bytes(w.kv_bytes_per_request)})"),
        ("memory needed", f"{fmt_bytes(w.memory_bytes_needed)} ({fits})"),
        ("prefill", f"{fmt_num(w.prefill.flops / 1e12)} TFLOP, {fmt_bytes(w.prefill.bytes)}, "
                    f"{fmt_num(w.prefill.arithmetic_intensity)} FLOP/byte: {w.prefill_bound}"),
        ("TTFT", f"{w.ttft_ms:.2f} ms"),
        ("decode", f"{fmt_num(w.decode_first.arithmetic_intensity)} FLOP/byte: {w.decode_bound}"
                   if w.decode_first else na),
        ("TPOT", f"{w.tpot_ms:.3f} ms ({w.output_throughput_tok_s:,.0f} tok/s)" if w.tpot_ms else na),
        ("e2e", f"{w.e2e_ms:.1f} ms"),
    ]
    if tp:
        rows[5] = ("memory needed", f"{fmt_bytes(w.memory_bytes_needed)} per device ({fits})")
        rows += _tensor_parallel_rows(w, predict(config, hw, args.prompt_tokens, args.output_tokens, dtype_bytes,
                                                 args.batch_size))
    for key, value in rows:
        table.add_row(key, value)
    console = Console()
    console.print(table)
    if tiers:
        if tp:
            warn("--tier-bandwidth weighs a load against one device's prefill, not the split's")
        console.print(_load_or_recompute_table(config, hw, args, dtype_bytes, tiers))
    return 0


def _tier_bandwidths(specs: list[str], hw) -> list[tuple[str, float]]:
    """(label, bytes/s) of each --tier-bandwidth: a preset (whatif.TIER_GB_S, or host: the hardware's copy
    bandwidth), a number of GB/s, or NAME=GB/S. UsageError for anything else, or a bandwidth not > 0."""
    from ..whatif import TIER_GB_S

    tiers = []
    for spec in specs:
        name, _, number = spec.rpartition("=")
        if spec == "host":  # calibrate's bandwidth counts read + write bytes; a copy does both (the engine's guess)
            tiers.append((f"host ({hw.name}'s memory)", hw.mem_bandwidth / 2))
            continue
        if spec in TIER_GB_S:
            name, number = spec, str(TIER_GB_S[spec])
        if "=" in spec and not name.strip():
            raise UsageError(f"--tier-bandwidth: {spec!r} has no name before '='; give NAME=GB/S, e.g. nas=1.2")
        try:
            gb_s = float(number)
        except ValueError:
            what = f"{number!r} is not a number of GB/s" if "=" in spec else f"unknown tier {spec!r}"
            raise UsageError(f"--tier-bandwidth: {what}; give host, {', '.join(TIER_GB_S)}, a number "
                             "of GB/s or NAME=GB/S") from None
        if not (math.isfinite(gb_s) and gb_s > 0):
            raise UsageError(f"--tier-bandwidth: {spec!r} is not a bandwidth > 0 GB/s")
        tiers.append((name or f"{gb_s:g} GB/s", gb_s * 1e9))
    names = [name for name, _ in tiers]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise UsageError(f"--tier-bandwidth: a tier is named twice ({', '.join(twice)}); give each a name of its own")
    return tiers


def _load_or_recompute_table(config, hw, args, dtype_bytes: int, tiers: list[tuple[str, float]]):
    """whatif.load_or_recompute for the --prompt-tokens prefix from each tier (none of it in the pool)."""
    from rich.table import Table

    from ..whatif import load_or_recompute

    answers = [(name, load_or_recompute(config, hw, bytes_per_s, args.prompt_tokens, 0, dtype_bytes))
               for name, bytes_per_s in tiers]
    first = answers[0][1]
    table = Table(title=f"load or recompute: the K/V of a {args.prompt_tokens:,}-token prefix, {args.dtype}",
                  show_header=False)
    table.add_row("KV bytes", f"{first.kv_bytes:,} ({fmt_bytes(first.kv_bytes)})")
    table.add_row("recompute", f"{fmt_num(first.recompute_ms, 4)} ms (the prefill's roofline floor on {hw.name})")
    table.add_row("break-even", f"{fmt_num(first.break_even_bytes_per_s / 1e9, 4)} GB/s (a faster tier loads, a "
                                "slower one recomputes)")
    for name, answer in answers:
        ratio = answer.recompute_ms / answer.load_ms
        verdict = (f"load, {ratio:,.2f}x faster than recompute" if answer.choice == "load"
                   else f"recompute, {1 / ratio:,.2f}x faster than the load")
        table.add_row(f"load from {name}", f"{fmt_num(answer.load_ms, 4)} ms at "
                                           f"{fmt_num(answer.tier_bytes_per_s / 1e9, 4)} GB/s: {verdict}")
    return table


def _tensor_parallel_rows(w, one) -> list[tuple[str, str]]:
    """What the all-reduces cost, and the split against ``one``, the same request on one device."""
    link = f"{w.interconnect_gb_s:g} GB/s each way" + (f", {w.latency_us:g} µs a ring step" if w.latency_us else "")
    comm = f"prefill {w.prefill_comm_ms:.3f} ms ({100 * w.prefill_comm_ms / w.ttft_ms:.0f}% of TTFT)"
    if w.tpot_ms:
        comm += f", decode {w.decode_comm_ms:.4f} ms a step ({100 * w.decode_comm_ms / w.tpot_ms:.0f}% of TPOT)"
    faster = [f"TTFT {one.ttft_ms / w.ttft_ms:.2f}x"] + ([f"TPOT {one.tpot_ms / w.tpot_ms:.2f}x"] if w.tpot_ms else [])
    slower = [phase for phase, split, alone in (("prefill", w.ttft_ms, one.ttft_ms), ("decode", w.tpot_ms, one.tpot_ms))
              if split and alone and split > alone]
    verdict = f"{' and '.join(slower)}: the all-reduces cost more than the split saves" if slower else \
        f"{w.tensor_parallel_size}x would be ideal"
    return [("tensor parallel", f"{w.tensor_parallel_size} devices, {link}; 2 ring all-reduces of "
                                "tokens x d_model a layer, each device sending 2(N-1)/N of its bytes"),
            ("all-reduces", comm),
            ("vs 1 device", f"speed-up {', '.join(faster)} ({verdict})")]


def _whatif_dtype(hardware: str, device: str) -> str:
    """The default --dtype: what load_model picks on this machine's device, bfloat16 on a datasheet GPU."""
    if hardware != "this":
        return "bfloat16"
    from ..device import resolve_device, resolve_dtype

    return str(resolve_dtype(None, resolve_device(device))).removeprefix("torch.")


def _whatif_hardware(name: str, device: str, dtype: str):
    from ..hardware import PROFILES, get_hardware, load_calibration

    if name == "this":
        if load_calibration(device, dtype) is None:
            print(f"minillm: no calibration for {device}/{dtype} yet; measuring it now (once)", file=sys.stderr)
        return get_hardware(device, dtype)
    if name not in PROFILES:
        raise UsageError(f"unknown --hardware {name!r}; known: {', '.join(PROFILES)}, this")
    return PROFILES[name]
