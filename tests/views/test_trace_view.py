"""The notebook view of a trace (``minillm.views.html.trace_html``) opened in a real headless Chromium.

The page must render and hold what a student looks at: one row per pass, time bars whose
widths are proportional to the measured times, top-k probability bars, the KV cache
filling up, per-layer rows at level "layers", token ids where there is no tokenizer.
Skips (with the reason) only when no Chromium/chromedriver or selenium is installed;
``.ci/run`` installs them.
"""


import pytest

from minillm import SamplingParams, generate, load_model
from minillm.trace import Trace
from minillm.views.html import trace_html

from tiny_models import CONFIGS, build_hf, save_hf

pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[browser]')")
from headless_browser import headless_chrome, needs_browser  # noqa: E402

pytestmark = [pytest.mark.browser, needs_browser]
N_NEW, PX = 6, 1.0  # tokens generated; bar widths are compared to 1 CSS pixel


class PieceTokenizer:
    """Just what a Trace needs of a tokenizer: a text per id, with markup that must stay literal."""

    def token_strings(self, ids):
        return [f"<b>{i}</b>\n" for i in ids]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    family, kwargs = CONFIGS["llama_gqa"]
    return load_model(save_hf(build_hf(family, kwargs), tmp_path_factory.mktemp("m")), device="cpu")


@pytest.fixture(scope="module")
def browser():
    driver = headless_chrome("1100,1400")
    yield driver
    driver.quit()


def open_trace(browser, trace, tmp_path):
    page = tmp_path / "trace.html"
    page.write_text(f"<!doctype html><meta charset='utf-8'><body>{trace_html(trace)}</body>")
    browser.get(page.as_uri())
    return browser


def traced(model, level="steps", tokenizer=None):
    trace = Trace(level, tokenizer=tokenizer)
    list(generate(model, [1, 2, 3, 4], SamplingParams(max_new_tokens=N_NEW), trace=trace, eos_token_ids=[]))
    return trace


def widths(elements):
    """(bar width, track width) in CSS pixels: each bar is drawn inside its grey track."""
    return [(e.rect["width"], e.find_element("xpath", "..").rect["width"]) for e in elements]


def test_steps_view_draws_bars_proportional_to_the_trace(model, browser, tmp_path):
    trace = traced(model)
    page = open_trace(browser, trace, tmp_path)
    by_css = lambda selector: page.find_elements("css selector", selector)  # noqa: E731
    rows = by_css("tr.minillm-step")
    assert len(rows) == N_NEW == len(trace.steps)
    font = page.find_element("css selector", ".minillm-trace").value_of_css_property("font-family")
    assert font.startswith("system-ui") and "serif" not in font.replace("sans-serif", "")
    # time bars: width / track = time_ms / the longest pass's time_ms
    times = [e["time_ms"] for e in trace.steps]
    for (bar, track), ms in zip(widths(by_css(".minillm-time-bar")), times, strict=True):
        assert bar == pytest.approx(track * ms / max(times), abs=PX)
    # top-k: one bar per candidate, width / track = its probability
    probs = [c["prob"] for e in trace.steps for c in e["candidates"]]
    for (bar, track), p in zip(widths(by_css(".minillm-topk-bar")), probs, strict=True):
        assert bar == pytest.approx(track * p, abs=PX)
    # the KV cache fills up: prompt positions, then one more per decode step
    lengths = [e["cache_length_after"] for e in trace.steps]
    for kv, n in zip(by_css(".minillm-kv-bar"), lengths, strict=True):
        prompt_part, decode_part = kv.find_elements("xpath", "./div")
        assert prompt_part.rect["width"] == pytest.approx(kv.rect["width"] * 4 / max(lengths), abs=PX)
        assert decode_part.rect["width"] == pytest.approx(kv.rect["width"] * (n - 4) / max(lengths), abs=PX)
    # no tokenizer: each row shows the id of the token the pass produced
    assert [r.find_elements("css selector", "td")[2].text for r in rows] == \
        [f"id {e['next_token_id']}" for e in trace.steps]
    assert not by_css(".minillm-layer")  # level "steps" records no layers
    shot = tmp_path / "steps.png"
    assert page.save_screenshot(str(shot)) and shot.stat().st_size > 10_000


def test_layers_view_has_a_row_per_layer_with_its_time(model, browser, tmp_path):
    trace = traced(model, "layers")
    page = open_trace(browser, trace, tmp_path)
    n_layers = model.config.n_layers
    assert len(page.find_elements("css selector", "tr.minillm-layer")) == n_layers
    shapes = [e.text for e in page.find_elements("css selector", ".minillm-layer-shapes")]
    assert shapes[0].startswith("step 0 (prefill): attention 1x4x64") and "K/V cache 1x2x4x16" in shapes[0]
    assert shapes[1].startswith("step 1 (decode): attention 1x1x64") and "K/V cache 1x2x5x16" in shapes[1]
    bars = widths(page.find_elements("css selector", ".minillm-layer-bar"))
    assert len(bars) == 2 * n_layers  # the prefill and the first decode step, side by side
    for step in (0, 1):
        ms = [e["time_ms"] for e in trace.layers(step)]
        for (bar, track), t in zip(bars[step::2], ms, strict=True):
            assert bar == pytest.approx(track * t / max(ms), abs=PX)
    assert f"{N_NEW - 2} more passes have layer events" in page.find_element("css selector", ".minillm-trace").text
    shot = tmp_path / "layers.png"
    assert page.save_screenshot(str(shot)) and shot.stat().st_size > 10_000


def test_token_texts_are_shown_literally(model, browser, tmp_path):
    trace = traced(model, tokenizer=PieceTokenizer())
    page = open_trace(browser, trace, tmp_path)
    tokens = [e.text for e in page.find_elements("css selector", "tr.minillm-step td:nth-child(3)")]
    assert tokens == [f"<b>{e['next_token_id']}</b>\\n {e['next_token_id']}" for e in trace.steps]
    assert not page.find_elements("css selector", ".minillm-trace b b")  # the markup stayed text
