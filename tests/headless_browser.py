"""Headless Chromium for the page tests (test_trace_view.py, serving/test_web_view.py): what to
skip on, and a driver. Debian's chromium and chromium-driver; `.ci/run` installs them if missing."""

import shutil

import pytest

BROWSER = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
DRIVER = shutil.which("chromedriver")
needs_browser = pytest.mark.skipif(
    BROWSER is None or DRIVER is None,
    reason="no headless browser: install Debian's chromium and chromium-driver (apt-get install -y chromium "
           "chromium-driver)",
)


def headless_chrome(window_size: str, console_log: bool = False):
    """A headless Chrome driver of ``window_size`` ("W,H"); ``console_log``: keep the JS console
    readable with ``driver.get_log("browser")``. The caller quits it."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = BROWSER
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={window_size}"):
        options.add_argument(arg)
    if console_log:
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=Service(DRIVER))
