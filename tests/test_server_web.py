"""The chat page at `/`, in a real headless Chromium (Debian's `chromium` + `chromium-driver`, driven by selenium;
.ci/run installs them): load it, send a message, see the streamed answer equal the API's greedy answer, stop a long
one, read the split-routing panel of a RESplit model, and check a screenshot is not blank.
"""
from __future__ import annotations

import io
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_proc import ServerProc

webdriver = pytest.importorskip("selenium.webdriver")
Image = pytest.importorskip("PIL.Image")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
if not (CHROMIUM and DRIVER):
    pytest.skip("needs chromium and chromedriver (apt-get install chromium chromium-driver)", allow_module_level=True)

KEY = {"Authorization": "Bearer sekret"}


@pytest.fixture(scope="module")
def srv(tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    s = ServerProc(tiny_qwen, "--parallel", "2", "-c", "4096", "-t", "1", "--api-key", "sekret",
                   log_path=tmp_path_factory.mktemp("server") / "web.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM  # type: ignore[assignment]
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1200,800"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def _wait(cond: Any, timeout: float = 30.0) -> Any:
    from selenium.common.exceptions import StaleElementReferenceException

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            v = cond()
        except StaleElementReferenceException:  # the page re-rendered the element between find and read: retry
            v = None
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError("timed out waiting")


def _set(driver: Any, element_id: str, value: str) -> None:
    el = driver.find_element("id", element_id)
    el.clear()
    el.send_keys(value)


def _open(driver: Any, srv: ServerProc) -> None:
    driver.get(srv.url + "/")
    driver.execute_script("localStorage.clear()")
    driver.get(srv.url + "/")
    _set(driver, "api_key", "sekret")
    _set(driver, "temperature", "0")
    _set(driver, "max_tokens", "24")


def test_page_is_served_without_a_key(srv: ServerProc) -> None:
    for path, kind in (("/", "text/html"), ("/static/app.js", "text/javascript"), ("/static/style.css", "text/css")):
        status, body = srv.request("GET", path)
        assert status == 200 and len(body) > 500, path
    assert srv.request("GET", "/rapidmoe/stats")[0] == 401
    status, s = srv.request("GET", "/rapidmoe/stats", headers=KEY)
    assert status == 200 and s["split"] is False and s["slots"] == 2


def test_chat_streams_the_greedy_answer(srv: ServerProc, browser: Any) -> None:
    _open(browser, srv)
    _set(browser, "input", "Tell me a story")
    browser.find_element("id", "send").click()
    _wait(lambda: browser.find_elements("css selector", ".msg.assistant .content"))
    _wait(lambda: browser.find_element("id", "send").is_enabled() and
          browser.find_element("css selector", ".msg.assistant .content").text)
    shown = browser.find_element("css selector", ".msg.assistant .content").get_attribute("textContent")
    status, ref = srv.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Tell me a story"}], "temperature": 0, "top_p": 0.95, "top_k": 40,
        "max_tokens": 24, "seed": -1}, headers=KEY)
    assert status == 200 and shown == ref["choices"][0]["message"]["content"] and shown
    speed = browser.find_element("id", "speed").text
    assert speed.endswith(" tok/s") and float(speed.split()[0]) > 0
    assert browser.find_element("css selector", "#conversations li span").text == "Tell me a story"
    png = browser.get_screenshot_as_png()
    img = Image.open(io.BytesIO(png)).convert("RGB")
    colors = img.getcolors(maxcolors=1 << 20)
    assert img.size[0] >= 1000 and colors is not None and len(colors) > 50  # text, sidebar, bubbles: not blank
    dark = sum(n for n, (r, g, b) in colors if r + g + b < 200)
    assert dark > 0.05 * img.size[0] * img.size[1]  # the dark sidebar is drawn


def test_stop_ends_the_answer_and_frees_the_slot(srv: ServerProc, browser: Any) -> None:
    _open(browser, srv)
    _set(browser, "max_tokens", "100000")
    _set(browser, "input", "Go on forever")
    browser.find_element("id", "send").click()
    _wait(lambda: browser.find_element("id", "stop").is_enabled())
    _wait(lambda: len(browser.find_element("css selector", ".msg.assistant .content").text) > 20)
    browser.find_element("id", "stop").click()
    _wait(lambda: browser.find_element("id", "send").is_enabled())
    _wait(lambda: not any(s["is_processing"] for s in srv.request("GET", "/slots", headers=KEY)[1]), 10)


def test_split_panel_shows_critical_share_and_histogram(make_split, tmp_path: Path, browser: Any) -> None:  # type: ignore[no-untyped-def]
    _, wq, wr = make_split("qwen3moe")
    s = ServerProc(wq, "--residual", str(wr), "-r", "1", "-t", "1", "-c", "1024", log_path=tmp_path / "split.log")
    try:
        status, r = s.request("POST", "/completion", {"prompt": "Hello there", "n_predict": 8})
        assert status == 200
        _, st = s.request("GET", "/rapidmoe/stats")
        assert st["split"] and st["critical_slots"] > 0 and len(st["layers"]) > 0
        k = st["k"]
        assert st["critical_fraction"] == pytest.approx(1 / k)  # r = 1 of top-k for every token
        assert all(layer["mean_r"] == pytest.approx(1.0) and layer["counts"][1] == sum(layer["counts"])
                   for layer in st["layers"])
        browser.get(s.url + "/")
        _wait(lambda: browser.find_element("id", "split").is_displayed())
        share = _wait(lambda: browser.find_element("id", "critical-share").text.strip("- "))
        assert share == f"{100 / k:.1f} %"
        rows = browser.find_elements("css selector", "#r-hist .row")
        assert len(rows) == len(st["layers"])
    finally:
        s.stop()
