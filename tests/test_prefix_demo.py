"""The prefix cache on the real default model: the shared-system-prompt demo and the CLI.

The demo must show a TTFT speedup above 1 for every request that finds the shared
system prompt cached, with unchanged answers.
"""

import re

import pytest

from minillm import load_model
from minillm.cli import main
from minillm.prefix_demo import POLICY, build_prompts, plot_prefix_demo, run_prefix_demo, system_prompt
from minillm.tokenizer import load_tokenizer

BLOCK = 16


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    return load_model(smollm2_dir, device="cpu"), load_tokenizer(smollm2_dir)


@pytest.mark.large
def test_the_shared_system_prompt_is_long(smollm2):
    _, tokenizer = smollm2
    assert len(tokenizer.encode(system_prompt())) >= 1000
    prompts = build_prompts(tokenizer, 3)
    assert len({tuple(p) for p in prompts}) == 3  # different questions


@pytest.mark.large
def test_demo_shows_a_ttft_speedup_with_the_same_answers(smollm2, tmp_path):
    model, tokenizer = smollm2
    result = run_prefix_demo(model, tokenizer, n_requests=3, block_size=BLOCK, max_new_tokens=4)
    cold, *warm = result.rows
    assert result.shared_prefix_tokens >= 1000
    assert cold.cached_tokens == 0 and cold.prefill_tokens == cold.prompt_tokens
    kv_per_token = model.config.kv_bytes_per_token(4)
    for row in warm:
        assert row.cached_tokens == result.shared_prefix_tokens // BLOCK * BLOCK  # every full shared block
        assert row.prefill_tokens == row.prompt_tokens - row.cached_tokens
        assert row.kv_bytes_saved == row.cached_tokens * kv_per_token
        assert row.speedup > 1, f"request {row.request}: TTFT {row.ttft_cache_ms:.0f} ms with the cache, " \
                                f"{row.ttft_no_cache_ms:.0f} ms without"
    assert all(row.same_output for row in result.rows)
    s = result.stats
    assert s.requests == 3 and s.hit_tokens == sum(r.cached_tokens for r in result.rows)
    assert s.hit_tokens % BLOCK == 0 and result.rows[-1].hit_rate == pytest.approx(s.hit_rate)
    assert result.warm_speedup > 1
    png = plot_prefix_demo(result, tmp_path / "demo.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.large
def test_cli_prefix_demo(smollm2_dir, tmp_path, capsys):
    png = tmp_path / "plot.png"
    assert main(["prefix-demo", "--model", str(smollm2_dir), "--requests", "2", "--max-new-tokens", "1",
                 "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "shared prompt tokens" in out and "warm requests: TTFT" in out and png.is_file()


@pytest.mark.large
def test_cli_generate_with_prefix_cache_marks_the_cached_prompt(smollm2_dir, capsys):
    system = " ".join(POLICY["Orders"])
    args = ["generate", "--model", str(smollm2_dir), "--system", system, "--prefix-cache", "--max-new-tokens", "2",
            "Can I cancel my order?", "How long is delivery?"]
    assert main(args) == 0
    summaries = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[prompt")]
    assert len(summaries) == 2 and "cached" not in summaries[0]
    cached = int(re.search(r"\((\d+) cached\)", summaries[1]).group(1))
    assert cached >= 100 and cached % 16 == 0  # the system prompt's full blocks
    assert main(args + ["--trace", "--no-warmup"]) == 0
    out = capsys.readouterr().err  # the trace panels: on stderr, the answer alone on stdout
    assert "from the prefix cache" in out and "prefix_lookup" in out and "prefix_hit" in out and "▶" in out


def test_cli_rejects_a_bad_block_size(capsys):
    assert main(["prefix-demo", "--block-size", "0"]) == 2
    assert "--block-size" in capsys.readouterr().err


@pytest.mark.cli
def test_cli_plot_must_be_a_png_checked_first(smollm2_dir, tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "minillm", "prefix-demo", "--plot", str(tmp_path / "p.txt")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "must end in .png" in r.stderr, r.stderr


@pytest.mark.large
def test_plot_with_one_request_says_n_a_not_nan(smollm2, tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from minillm.prefix_demo import plot_prefix_demo, run_prefix_demo

    model, tok = smollm2
    result = run_prefix_demo(model, tok, n_requests=1, max_new_tokens=2)
    titles = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, **kw: titles.append(fig.axes[0].get_title()))
    plot_prefix_demo(result, tmp_path / "demo.png")
    assert "n/a (one request)" in titles[0] and "nan" not in titles[0]
