"""The live web view (GET /) in a real headless Chromium, against a running server.

A random-weight tiny Llama with SmolLM2's vocabulary (conftest's ``tiny_chat``: SmolLM2's
tokenizer and chat template work) answers in milliseconds per step; 300 new tokens keep a
request running long enough to watch. The page must stream the answer over SSE (the same
text the engine produced for that request id), draw the request's blocks in the pool grid
while it runs (only the blocks its table holds), draw the batch, list it as finished with
its numbers, and log no JavaScript error. Stop closes a stream and the server frees the
request's blocks; a request queued behind max_num_seqs and a preempted one are listed as
waiting; the page polls only while its tab is visible; bad input is said on the page.
Skips (with the reason) only when no Chromium/chromedriver or selenium is installed;
``.ci/run`` installs them.
"""

import time

import pytest

from minillm import LLMEngine, SamplingParams
from minillm.serving.server.web_view import engine_state

pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[browser]')")
from headless_browser import headless_chrome, needs_browser  # noqa: E402
pytest.importorskip("fastapi", reason="the server extra is not installed (pip install -e '.[serve]')")
from live_server import app_of, live_server  # noqa: E402  (needs fastapi and uvicorn)

pytestmark = [pytest.mark.browser, needs_browser]
MAX_TOKENS, NUM_BLOCKS, BLOCK_SIZE = 300, 64, 16
WAIT_S = 60  # every wait below is bounded by this


@pytest.fixture(scope="module")
def server(tiny_chat):
    model, tokenizer = tiny_chat
    with live_server(model, tokenizer, model_name="tiny-web", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    driver = headless_chrome("1600,1000", console_log=True)
    yield driver
    driver.quit()


def wait_for(condition, what: str, timeout_s: float = WAIT_S, every_s: float = 0.05):
    """Poll ``condition()`` until it returns something truthy; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every_s)
    pytest.fail(f"waited {timeout_s} s for {what}")


def open_page(browser, url, num_blocks=NUM_BLOCKS):
    browser.get(f"{url}/")
    wait_for(lambda: browser.find_element("id", "model").text == "tiny-web", "the model's name from /v1/models")
    css = lambda selector: browser.find_elements("css selector", selector)  # noqa: E731
    wait_for(lambda: len(css("#grid .block")) == num_blocks, "the pool grid, a square per block")
    return css


def console_errors(browser):
    """(JavaScript errors, failed network loads) logged since the last call."""
    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    return [e for e in severe if e.get("source") != "network"], [e for e in severe if e.get("source") == "network"]


COUNT_STATE_FETCHES = """
window.stateFetches = 0;
const fetch0 = window.fetch;
window.fetch = (url, ...rest) => { if (String(url).endsWith("/engine/state")) window.stateFetches++;
                                   return fetch0(url, ...rest); };
"""
SET_HIDDEN = """
Object.defineProperty(document, "hidden", {value: arguments[0], configurable: true});
document.dispatchEvent(new Event("visibilitychange"));
"""


def engine_of(url):
    return app_of(url).state.async_engine


def test_a_prompt_streams_and_the_pool_shows_its_blocks_while_it_runs(server, browser, tmp_path):
    css = open_page(browser, server)
    browser.find_element("id", "max-tokens").clear()
    browser.find_element("id", "max-tokens").send_keys(str(MAX_TOKENS))
    browser.find_element("id", "prompt").clear()
    browser.find_element("id", "prompt").send_keys("What does a KV cache hold?")
    browser.find_element("id", "send").click()

    text = lambda: css(".answer .text")[0].get_attribute("textContent")  # noqa: E731  (exact, not .text)
    first = wait_for(text, "the first streamed text")
    request_id = css(".answer")[0].get_attribute("data-request-id")
    assert request_id
    wait_for(lambda: len(text()) > len(first), "the streamed text to grow")

    # while it runs: its blocks (and only its) are drawn as used, and the batch has its row
    used = wait_for(lambda: css("#grid .block.used"), "used blocks in the grid while the request runs")
    assert {cell.get_attribute("data-request-ids") for cell in used} == {request_id}
    assert 1 <= len(used) <= -(-(MAX_TOKENS + 100) // BLOCK_SIZE)
    wait_for(lambda: css(f'#batch .batch-row[data-request-id="{request_id}"]'), "the request's row in the batch")
    browser.save_screenshot(str(tmp_path / "running.png"))

    wait_for(lambda: "finish:" in css(".answer .meta")[0].text, "the stream's finish reason")
    async_engine = engine_of(server)
    with async_engine.lock:
        request = async_engine.engine.requests[request_id]
        assert request.finished and text() == request.text_stream.text  # what the engine produced, all of it
        assert request.params.temperature == 0.2  # the page's default (not OpenAI's 1.0 for an omitted one)
        n_output = len(request.output_ids)
    row = wait_for(lambda: css(f'#finished tr[data-request-id="{request_id}"]'), "the finished request's row")[0]
    cells = [td.text for td in row.find_elements("css selector", "td")]
    assert float(cells[1]) > 0 and float(cells[2]) > 0  # TTFT and TPOT in ms
    assert int(cells[3]) == n_output and cells[6] == request.finish_reason
    wait_for(lambda: not css("#grid .block.used"), "the pool to be free again")
    with async_engine.lock:
        num_cached = async_engine.engine.cache.allocator.num_cached_blocks
    assert num_cached > 0 and len(css("#grid .block.cached")) == num_cached  # prefix caching kept its blocks

    shot = tmp_path / "web_view.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    assert console_errors(browser) == ([], [])


def test_stop_closes_the_stream_and_the_server_frees_the_requests_blocks(server, browser):
    css = open_page(browser, server)
    browser.find_element("id", "max-tokens").clear()
    browser.find_element("id", "max-tokens").send_keys("450")  # longer than the wait below
    browser.find_element("id", "prompt").clear()
    browser.find_element("id", "prompt").send_keys("Tell me a long story.")
    browser.find_element("id", "send").click()
    wait_for(lambda: css(".answer .text")[0].get_attribute("textContent"), "the first streamed text")
    request_id = css(".answer")[0].get_attribute("data-request-id")
    wait_for(lambda: css("#grid .block.used"), "the request's blocks in the grid")
    css(".answer .stop")[0].click()

    wait_for(lambda: css(".answer.stopped"), "the card to say it stopped")
    async_engine = engine_of(server)

    def aborted():
        with async_engine.lock:
            request = async_engine.engine.requests[request_id]
            return request.finished and request.finish_reason
    assert wait_for(aborted, "the server to end the request", timeout_s=10) == "abort"
    with async_engine.lock:
        pool = async_engine.engine.cache.allocator
        assert pool.num_used_blocks == 0 and not pool.block_tables  # its blocks went back at once
    wait_for(lambda: not css("#grid .block.used"), "the grid to show the blocks free")
    assert not css(".answer .stop") and console_errors(browser)[0] == []  # an abort is not a JS error


def test_copies_queue_behind_max_num_seqs_and_the_page_lists_the_waiting_one(tiny_chat, browser):
    model, tokenizer = tiny_chat
    with live_server(model, tokenizer, model_name="tiny-web", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                     max_num_seqs=1) as url:
        css = open_page(browser, url)
        browser.find_element("id", "max-tokens").clear()
        browser.find_element("id", "max-tokens").send_keys("450")
        browser.find_element("id", "copies").clear()
        browser.find_element("id", "copies").send_keys("2")
        browser.find_element("id", "send").click()
        wait_for(lambda: len(css(".answer")) == 2, "two answer cards")
        text = lambda: browser.find_element("id", "waiting-list").text  # noqa: E731
        wait_for(lambda: text().startswith("waiting: "), "the waiting request listed")
        wait_for(lambda: browser.find_element("id", "running").text == "1", "one running request")
        assert browser.find_element("id", "waiting").text == "1"
        async_engine = engine_of(url)
        with async_engine.lock:
            (waiting,) = async_engine.engine.scheduler.waiting
        assert text() == f"waiting: {waiting.request_id.split('-')[-1][:6]}… (prompt {waiting.num_prompt_tokens})"
        for stop in css(".answer .stop"):
            stop.click()
        wait_for(lambda: not css(".answer .stop"), "both streams stopped")
        browser.get("about:blank")  # leave before this server stops: no poll of a closed port
        assert console_errors(browser)[0] == []


def test_a_preemption_is_drawn_from_the_engines_own_state(server, browser, tiny_model):
    # A preemption lasts a step or two in a live server (the victim is readmitted as soon as its
    # blocks are back), too short for a 250 ms poll: so a hand-stepped engine's state is drawn
    # by the page's own render(). 6 blocks of 4: two requests of 8 + 12 tokens cannot both fit.
    engine = LLMEngine(tiny_model("llama_gqa"), num_blocks=6, block_size=4, eos_token_ids=())
    for seed in (0, 1):
        engine.add_request(list(range(seed, seed + 8)), SamplingParams(max_new_tokens=12))
    while not (engine.steps and engine.steps[-1].preempted):
        engine.step()
    (victim_id,) = engine.steps[-1].preempted
    victim, pool = engine.requests[victim_id], engine.cache.allocator
    css = open_page(browser, server)
    browser.execute_script(SET_HIDDEN, True)  # no poll of the server overwrites the drawing
    browser.execute_script("render(arguments[0])", engine_state(engine))

    assert browser.find_element("id", "waiting-list").text == \
        f"waiting: {victim_id} (prompt 8, preempted 1×: recomputes up to {8 + len(victim.output_ids)} tokens)"
    assert browser.find_element("id", "step-summary").text.endswith(f"· preempted {victim_id}")
    cells = css("#grid .block")
    assert len(cells) == pool.num_blocks == 6
    for cell, block in zip(cells, pool.blocks):
        holders = [rid for rid, table in pool.block_tables.items() if block.block_id in table]
        assert cell.get_attribute("data-request-ids") == (" ".join(holders) if holders else None)
        assert victim_id not in holders  # its blocks went back to the pool
    assert console_errors(browser)[0] == []


def test_the_page_polls_only_while_the_tab_is_visible(server, browser):
    open_page(browser, server)
    browser.execute_script(COUNT_STATE_FETCHES)
    fetches = lambda: browser.execute_script("return window.stateFetches")  # noqa: E731
    wait_for(lambda: fetches() >= 3, "a few polls of /engine/state", timeout_s=10)
    browser.execute_script(SET_HIDDEN, True)
    time.sleep(0.5)  # a poll in flight may still land
    hidden_at = fetches()
    time.sleep(1.5)  # 6 polling periods
    assert fetches() == hidden_at
    browser.execute_script(SET_HIDDEN, False)
    wait_for(lambda: fetches() >= hidden_at + 3, "polling to resume", timeout_s=10)
    assert console_errors(browser) == ([], [])


def test_bad_input_is_said_on_the_page(server, browser):
    css = open_page(browser, server)
    browser.find_element("id", "prompt").clear()
    browser.find_element("id", "send").click()
    assert browser.find_element("id", "form-error").text == "type a prompt first" and not css(".answer")

    browser.find_element("id", "prompt").send_keys("Hello")
    browser.find_element("id", "temperature").clear()
    browser.find_element("id", "temperature").send_keys("3")
    browser.find_element("id", "send").click()
    assert browser.find_element("id", "form-error").text == "temperature must be from 0 to 2" and not css(".answer")
    browser.find_element("id", "temperature").clear()
    browser.find_element("id", "temperature").send_keys("0")
    browser.find_element("id", "prompt").clear()

    browser.find_element("id", "prompt").send_keys("Hello")
    browser.find_element("id", "max-tokens").clear()
    browser.find_element("id", "max-tokens").send_keys("5000")  # more than tiny_chat's context of 512
    browser.find_element("id", "send").click()
    card = wait_for(lambda: css(".answer.failed"), "the server's error on the page")[0]
    message = card.find_element("css selector", ".text").text
    assert "512" in message  # the server's OpenAI error message, naming the context limit
    errors, failed_loads = console_errors(browser)
    assert errors == []  # a 400 answer is shown, not thrown
    assert [" 400 " in e["message"] for e in failed_loads] == [True]  # (the console log is really read)


def test_a_server_with_an_api_key_is_used_from_the_page_with_its_key(tiny_chat, browser):
    model, tokenizer = tiny_chat
    with live_server(model, tokenizer, model_name="tiny-web", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                     api_key="s3cret") as url:
        browser.get(f"{url}/")

        def says_how_to_give_the_key():
            browser.find_element("id", "send").click()  # refused on the page: no model name without the key
            return "open this page as /?api_key=KEY" in browser.find_element("id", "form-error").text

        wait_for(says_how_to_give_the_key, "the page saying the server wants its API key")
        browser.get(f"{url}/?api_key=s3cret")
        wait_for(lambda: browser.find_element("id", "model").text == "tiny-web", "the model's name, with the key")
        css = lambda selector: browser.find_elements("css selector", selector)  # noqa: E731
        browser.find_element("id", "max-tokens").clear()
        browser.find_element("id", "max-tokens").send_keys("4")
        browser.find_element("id", "send").click()
        wait_for(lambda: "finish:" in css(".answer .meta")[0].text, "the keyed stream's finish reason")
        assert not css(".answer.failed")
        browser.get("about:blank")
        assert console_errors(browser)[0] == []
