"""The chat page at `/`, in a real headless Chromium (Debian's `chromium` + `chromium-driver`, driven by selenium;
.ci/run installs them): load it, send a message, see the streamed answer equal the API's greedy answer, stop a long
one, keep a conversation going after a failed turn (context size, wrong key) without sending the failure back, retry
an earlier failed turn in place, keep roles alternating after an answer without content (under a template that
refuses anything else), leave cleared fields out of the request, edit/regenerate/delete messages, never
start a second generation while one streams, render markdown (in linear time) while HTML in the model's output
stays text, read the split-routing panel of a RESplit model, and check a screenshot is not blank.
"""
from __future__ import annotations

import io
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_proc import ServerProc
from testkit import sanitizer_free_env

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
    from selenium.webdriver.chrome.options import Options  # noqa: PLC0415 - selenium is optional (importorskip)
    from selenium.webdriver.chrome.service import Service  # noqa: PLC0415

    opts = Options()
    opts.binary_location = CHROMIUM  # type: ignore[assignment]
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1200,800"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER, env=sanitizer_free_env()), options=opts)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def _wait(cond: Any, timeout: float = 30.0) -> Any:
    from selenium.common.exceptions import StaleElementReferenceException  # noqa: PLC0415 - optional, as above

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


def _chat(driver: Any) -> list[dict[str, Any]]:
    """The current conversation's messages as the page stored them."""
    state = json.loads(driver.execute_script("return localStorage.getItem('rapidmoe.chats')"))
    return next(c for c in state["chats"] if c["id"] == state["current"])["messages"]


def _idle(driver: Any) -> None:
    """Waits until no answer is being generated (Send enabled, Stop disabled)."""
    _wait(lambda: driver.find_element("id", "send").is_enabled() and not driver.find_element("id", "stop").is_enabled())


def _answer(driver: Any) -> tuple[str, str]:
    """(content, reasoning) of the last answer, once it is complete and has no error."""
    _idle(driver)
    last = _chat(driver)[-1]
    assert last["role"] == "assistant" and "error" not in last, last
    return last["content"], last.get("reasoning", "")


def _reference(srv: ServerProc, messages: list[dict[str, str]], max_tokens: int) -> tuple[str, str]:
    """The API's greedy answer with the page's default sampling fields: (content, reasoning_content)."""
    status, r = srv.request("POST", "/v1/chat/completions", {
        "messages": messages, "temperature": 0, "top_p": 0.95, "top_k": 40, "max_tokens": max_tokens, "seed": -1},
        headers=KEY)
    assert status == 200, r
    m = r["choices"][0]["message"]
    return m.get("content") or "", m.get("reasoning_content") or ""


RECORD_REQUESTS = """window.__bodies = [];
const fetch0 = window.fetch;
window.fetch = (url, opts) => {
  if (String(url).endsWith('/v1/chat/completions')) window.__bodies.push(JSON.parse(opts.body));
  return fetch0(url, opts);
};"""


def _bodies(driver: Any) -> list[dict[str, Any]]:
    """The bodies of the page's /v1/chat/completions requests since RECORD_REQUESTS ran."""
    return driver.execute_script("return window.__bodies")


def _click(driver: Any, msg: int, action: str) -> None:
    """Clicks the `action` button (edit, save, regenerate, delete, retry, remove) of the msg-th message bubble."""
    driver.find_elements("css selector", "#messages .msg")[msg].find_element(
        "css selector", f"button[data-action='{action}']").click()


def _type(driver: Any, text: str) -> None:
    """Puts text in the message box (set directly: send_keys is slow for long text) and sends it."""
    driver.execute_script("document.getElementById('input').value = arguments[0]", text)
    driver.find_element("id", "send").click()


def test_page_is_served_without_a_key(srv: ServerProc) -> None:
    for path in ("/", "/static/app.js", "/static/markdown.js", "/static/style.css"):
        status, body = srv.request("GET", path)
        assert status == 200 and len(body) > 500, path
    assert srv.request("GET", "/rapidmoe/stats")[0] == 401
    status, s = srv.request("GET", "/rapidmoe/stats", headers=KEY)
    assert status == 200 and s["split"] is False and s["slots"] == 2


def test_chat_streams_the_greedy_answer(srv: ServerProc, browser: Any) -> None:
    _open(browser, srv)
    _set(browser, "input", "Tell me a story")
    browser.find_element("id", "send").click()
    shown = _answer(browser)
    ref = _reference(srv, [{"role": "user", "content": "Tell me a story"}], max_tokens=24)
    assert shown == ref and any(shown)
    reasoning = browser.find_elements("css selector", ".msg.assistant .reasoning")
    assert [r.get_attribute("textContent") for r in reasoning] == ([shown[1]] if shown[1] else [])
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
    _wait(lambda: len(browser.find_element("css selector", ".msg.assistant").text) > 20)
    browser.find_element("id", "stop").click()
    _idle(browser)
    assert _chat(browser)[-1].get("stopped") is True
    _wait(lambda: not any(s["is_processing"] for s in srv.request("GET", "/slots", headers=KEY)[1]), 10)


def test_a_failed_turn_is_shown_but_never_sent_again(srv: ServerProc, browser: Any) -> None:
    _open(browser, srv)
    browser.execute_script(RECORD_REQUESTS)
    _set(browser, "max_tokens", "8")
    _type(browser, "word " * 3000)  # over the 2048 tokens of a slot
    _idle(browser)
    assert "exceeds the available context size" in browser.find_element("id", "messages").text
    _type(browser, "Hi")
    _idle(browser)
    assert _bodies(browser)[-1]["messages"] == [{"role": "user", "content": "Hi"}]
    assert _answer(browser) == _reference(srv, [{"role": "user", "content": "Hi"}], max_tokens=8)
    error = browser.find_element("css selector", ".msg.assistant.failed .error").text
    assert "exceeds the available context size" in error
    assert browser.find_elements("css selector", ".msg.user.failed")  # the turn is marked as left out
    shown = _answer(browser)
    _click(browser, 1, "remove")  # the failed turn: its user message and the error go
    assert [m["content"] for m in _chat(browser)] == ["Hi", shown[0]]
    assert len(browser.find_elements("css selector", "#messages .msg")) == 2
    assert not browser.find_elements("css selector", ".msg.failed")


def _first_turn_fails_on_a_wrong_key(srv: ServerProc, browser: Any) -> None:
    """A fresh page recording its requests; "Hello" sent with a wrong API key (8 tokens at most); the key then
    set right."""
    _open(browser, srv)
    browser.execute_script(RECORD_REQUESTS)
    _set(browser, "api_key", "wrong")
    _set(browser, "max_tokens", "8")
    _type(browser, "Hello")
    _idle(browser)
    assert "Invalid API Key" in browser.find_element("id", "messages").text
    _set(browser, "api_key", "sekret")


def test_a_wrong_key_is_an_error_in_the_page_and_retry_sends_the_turn_alone(srv: ServerProc, browser: Any) -> None:
    _first_turn_fails_on_a_wrong_key(srv, browser)
    _type(browser, "Hello again")  # a new turn after the failed one: sent alone
    _idle(browser)
    assert _bodies(browser)[-1]["messages"] == [{"role": "user", "content": "Hello again"}]
    assert browser.find_element("css selector", ".msg.assistant.failed .error").text == "Invalid API Key"
    _click(browser, 3, "delete")  # the answer, then the message: back to the failed turn alone
    _click(browser, 2, "delete")
    _click(browser, 1, "retry")
    shown = _answer(browser)
    assert [b["messages"] for b in _bodies(browser)][::2] == [[{"role": "user", "content": "Hello"}]] * 2
    assert shown == _reference(srv, [{"role": "user", "content": "Hello"}], max_tokens=8)
    assert len(_chat(browser)) == 2 and not browser.find_elements("css selector", ".msg.failed")


def test_retry_of_an_earlier_failed_turn_answers_it_in_place(srv: ServerProc, browser: Any) -> None:
    _first_turn_fails_on_a_wrong_key(srv, browser)
    _type(browser, "Hello again")
    later = _answer(browser)
    _click(browser, 1, "retry")  # not the last turn: the later messages stay as they are
    _idle(browser)
    hello = [{"role": "user", "content": "Hello"}]
    assert _bodies(browser)[-1]["messages"] == hello  # the history before the failed turn, and the turn
    chat = _chat(browser)
    assert [m["content"] for m in chat] == ["Hello", chat[1]["content"], "Hello again", later[0]]
    assert (chat[1]["content"], chat[1]["reasoning"]) == _reference(srv, hello, max_tokens=8)
    assert (chat[3]["content"], chat[3]["reasoning"]) == later
    assert not any("error" in m for m in chat) and not browser.find_elements("css selector", ".msg.failed")
    assert len(browser.find_elements("css selector", "#messages .msg")) == 4


def test_error_messages_stored_by_an_older_page_are_not_sent(srv: ServerProc, browser: Any) -> None:
    _open(browser, srv)
    old = {"chats": [{"id": "c1", "title": "Hi", "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "reasoning": ""},
        {"role": "error", "content": "Invalid API Key"}]}], "current": "c1"}
    browser.execute_script("localStorage.setItem('rapidmoe.chats', arguments[0])", json.dumps(old))
    browser.get(srv.url + "/")
    browser.execute_script(RECORD_REQUESTS)
    _type(browser, "Hello")
    _answer(browser)
    assert _bodies(browser)[-1]["messages"] == [{"role": "user", "content": "Hello"}]
    assert browser.find_element("css selector", ".msg.assistant.failed .error").text == "Invalid API Key"


# Gemma's rule (Mistral's is the same after an optional system message) with a generation prompt that opens <think>,
# as Qwen3's and DeepSeek-R1's do: the answer starts as reasoning.
ALTERNATING = """{%- for message in messages -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}
{%- endif -%}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n<think>\\n' -}}{%- endif -%}
"""


def test_an_answer_without_content_keeps_roles_alternating(tiny_qwen: Path, tmp_path: Path, browser: Any) -> None:
    """Under a template that fails on two user turns in a row, an answer that is all reasoning (4 tokens inside
    <think>), and then one that streamed nothing, are sent with the next turn as empty assistant messages, and
    each next turn succeeds; a deleted user message leaves an empty one in its place."""
    template = tmp_path / "alternating.jinja"
    template.write_text(ALTERNATING)
    s = ServerProc(tiny_qwen, "--chat-template-file", str(template), "-t", "1", "-c", "1024",
                   log_path=tmp_path / "alternating.log")
    try:
        two_users = [{"role": "user", "content": "Hello"}, {"role": "user", "content": "Again"}]
        status, r = s.request("POST", "/v1/chat/completions", {"messages": two_users, "max_tokens": 1})
        assert status == 400 and "roles must alternate" in r["error"]["message"], r
        browser.get(s.url + "/")
        browser.execute_script("localStorage.clear()")
        browser.get(s.url + "/")
        _set(browser, "temperature", "0")
        _set(browser, "max_tokens", "4")
        browser.execute_script(RECORD_REQUESTS)
        _type(browser, "Hello")
        content, reasoning = _answer(browser)
        assert content == "" and reasoning, (content, reasoning)
        _type(browser, "Again")
        _answer(browser)
        assert _bodies(browser)[-1]["messages"] == [two_users[0], {"role": "assistant", "content": ""}, two_users[1]]
        _fake_stream(browser, "")  # an answer with nothing in it
        _type(browser, "Once more")
        _idle(browser)
        assert _chat(browser)[-1] == {"role": "assistant", "content": "", "reasoning": ""}
        browser.get(s.url + "/")  # the page's own fetch again
        browser.execute_script(RECORD_REQUESTS)
        _type(browser, "Last")
        _answer(browser)
        messages = _bodies(browser)[-1]["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant"] * 3 + ["user"], messages
        assert messages[4:] == [{"role": "user", "content": "Once more"}, {"role": "assistant", "content": ""},
                                {"role": "user", "content": "Last"}]
        _click(browser, 2, "delete")  # "Again": two answers in a row, an empty user message goes between
        _type(browser, "End")
        _answer(browser)
        messages = _bodies(browser)[-1]["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant"] * 4 + ["user"], messages
        assert messages[2] == {"role": "user", "content": ""} and messages[-1]["content"] == "End"
    finally:
        s.stop()


def test_cleared_fields_are_left_out_of_the_request(srv: ServerProc, browser: Any) -> None:
    _open(browser, srv)
    browser.execute_script(RECORD_REQUESTS)
    for field in ("max_tokens", "temperature", "top_k", "seed"):
        browser.find_element("id", field).clear()
    _type(browser, "Go on")
    _wait(lambda: _bodies(browser))
    body = _bodies(browser)[0]
    assert {k: v for k, v in body.items() if k != "messages"} == {
        "stream": True, "timings_per_token": True, "top_p": 0.95}
    _wait(lambda: len(_chat(browser)[-1]["content"] + _chat(browser)[-1]["reasoning"]) > 20)  # not an empty answer
    browser.find_element("id", "stop").click()
    _idle(browser)
    browser.get(srv.url + "/")  # a cleared field stays cleared
    assert browser.find_element("id", "max_tokens").get_attribute("value") == ""


def test_a_field_that_is_not_a_number_fails_the_turn_without_a_request(srv: ServerProc, browser: Any) -> None:
    _open(browser, srv)
    browser.execute_script(RECORD_REQUESTS)
    _set(browser, "temperature", "1e")  # the browser's number field reads this as no value (badInput)
    _type(browser, "Hi")
    _idle(browser)
    assert browser.find_element("css selector", ".msg.assistant.failed .error").text == "Temperature is not a number"
    assert _bodies(browser) == []


def test_edit_regenerate_and_delete(srv: ServerProc, browser: Any) -> None:
    _open(browser, srv)
    browser.execute_script(RECORD_REQUESTS)
    _set(browser, "max_tokens", "8")
    story = [{"role": "user", "content": "Tell me a story"}]
    _type(browser, story[0]["content"])
    first = _answer(browser)
    _click(browser, 1, "regenerate")
    assert _answer(browser) == first == _reference(srv, story, max_tokens=8)
    assert [b["messages"] for b in _bodies(browser)] == [story, story] and len(_chat(browser)) == 2

    _click(browser, 0, "edit")  # a user message: the answer after it is replaced
    editor = browser.find_element("css selector", ".msg.user .editor textarea")
    editor.clear()
    editor.send_keys("Hello there")
    _click(browser, 0, "save")
    hello = [{"role": "user", "content": "Hello there"}]
    assert _answer(browser) == _reference(srv, hello, max_tokens=8)
    assert _bodies(browser)[-1]["messages"] == hello
    assert [m["content"] for m in _chat(browser)][:1] == ["Hello there"] and len(_chat(browser)) == 2
    assert browser.find_element("css selector", "#conversations li.active span").text == "Hello there"

    _click(browser, 1, "edit")  # an answer: changed in place, nothing sent
    editor = browser.find_element("css selector", ".msg.assistant .editor textarea")
    editor.clear()
    editor.send_keys("Edited `answer`")
    _click(browser, 1, "save")
    assert len(_bodies(browser)) == 3 and _chat(browser)[1]["content"] == "Edited `answer`"
    assert browser.find_element("css selector", ".msg.assistant .content code").text == "answer"
    _type(browser, "Next")
    _answer(browser)
    assert _bodies(browser)[-1]["messages"] == [*hello, {"role": "assistant", "content": "Edited `answer`"},
                                                 {"role": "user", "content": "Next"}]

    _click(browser, 3, "delete")
    _click(browser, 2, "delete")
    assert [m["content"] for m in _chat(browser)] == ["Hello there", "Edited `answer`"]
    assert len(browser.find_elements("css selector", "#messages .msg")) == 2


HANGING_STREAM = """window.__bodies = [];
window.fetch = async (url, opts) => {  // chat requests stream one delta, then hang until the page aborts them
  if (!String(url).endsWith('/v1/chat/completions')) return new Response('{}', {status: 404});
  window.__bodies.push(JSON.parse(opts.body));
  const event = 'data: ' + JSON.stringify({choices: [{index: 0, delta: {content: 'streaming'}}]}) + '\\n\\n';
  const body = new ReadableStream({start(c) {
    c.enqueue(new TextEncoder().encode(event));
    opts.signal.addEventListener('abort', () => c.error(new DOMException('stopped', 'AbortError')));
  }});
  return new Response(body, {headers: {'Content-Type': 'text/event-stream'}});
};"""


def test_no_second_generation_starts_while_an_answer_streams(srv: ServerProc, browser: Any) -> None:
    _open(browser, srv)
    _set(browser, "max_tokens", "8")
    _type(browser, "Tell me a story")
    first = _answer(browser)
    browser.execute_script(HANGING_STREAM)
    _click(browser, 0, "edit")  # an editor left open while the next message is sent from the composer
    browser.execute_script("window.__area = document.querySelector('.msg.user .editor textarea')")
    _type(browser, "Next")
    _wait(lambda: browser.find_element("id", "stop").is_enabled() and _bodies(browser))
    assert browser.find_elements("css selector", ".editor") == []  # sending closes the editor
    # Ctrl+Enter in that editor (its textarea, held from before) and every action button: none may start a request
    browser.execute_script("""window.__area.dispatchEvent(new KeyboardEvent('keydown',
        {key: 'Enter', ctrlKey: true, bubbles: true, cancelable: true}));
      for (const b of document.querySelectorAll('#messages button[data-action]')) b.onclick();""")
    time.sleep(0.3)
    assert len(_bodies(browser)) == 1
    assert [m["content"] for m in _chat(browser)] == ["Tell me a story", first[0], "Next", ""]  # saved at the end
    assert browser.find_element("css selector", ".msg.assistant.streaming").text == "streaming"
    browser.find_element("id", "stop").click()  # Stop still stops the one generation
    _idle(browser)
    assert _chat(browser)[-1] == {"role": "assistant", "content": "streaming", "reasoning": "", "stopped": True}
    assert len(_chat(browser)) == 4 and len(_bodies(browser)) == 1


HOSTILE = ('<img src=x onerror="window.__pwned=1"> <script>window.__pwned=2</script> '
           '[click](javascript:window.__pwned=3) <a href="javascript:window.__pwned=4">a</a>')
MARKDOWN = ("# Title\n\nSome **bold**, *italic* and `inline <b>code</b>` text, a [link](https://example.com/a_b).\n\n"
            "- one\n- two\n  1. nested\n\n```python\nprint('<script>alert(1)</script>')\n```\n\n" + HOSTILE)


def _fake_stream(driver: Any, text: str) -> None:
    """Makes the page's next chat request answer `text` as one SSE delta, as the server streams model output."""
    event = "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": text}}]}) + "\n\ndata: [DONE]\n\n"
    driver.execute_script("""const event = arguments[0];
      window.fetch = async () => new Response(event, {headers: {'Content-Type': 'text/event-stream'}});""", event)


def test_markdown_renders_and_model_html_stays_text(srv: ServerProc, browser: Any) -> None:
    _open(browser, srv)
    _fake_stream(browser, MARKDOWN)
    _type(browser, "Show me markdown")
    _idle(browser)
    md = browser.find_element("css selector", ".msg.assistant .content.markdown")
    assert md.find_element("css selector", "h1").text == "Title"
    assert [e.text for e in md.find_elements("css selector", "p > strong, p > em")] == ["bold", "italic"]
    assert md.find_element("css selector", "p > code").text == "inline <b>code</b>"
    a = md.find_element("css selector", "p > a")
    assert (a.text, a.get_attribute("href")) == ("link", "https://example.com/a_b")
    assert [e.text for e in md.find_elements("css selector", "ul > li")][:1] == ["one"]
    assert md.find_element("css selector", "ul > li > ol > li").text == "nested"
    code = md.find_element("css selector", "pre > code.language-python")
    assert code.get_attribute("textContent") == "print('<script>alert(1)</script>')"
    last = md.find_elements("css selector", ":scope > p")[-1]  # the hostile line: all of it text, no element made
    assert last.get_attribute("textContent") == HOSTILE.replace("[click](javascript:window.__pwned=3)", "click")
    assert last.find_elements("css selector", "*") == []
    assert browser.find_elements("css selector", "#messages img, #messages script, #messages b") == []
    assert [a.get_attribute("href") for a in browser.find_elements("css selector", "#messages a")] == [
        "https://example.com/a_b"]
    browser.get(srv.url + "/")  # rendered again from localStorage on load: still text
    assert browser.find_elements("css selector", "#messages img, #messages script") == []
    time.sleep(0.5)
    assert browser.execute_script("return window.__pwned") is None


MARKDOWN_CASES = [  # (markdown, the HTML markdown.js must build for it), written by hand: CommonMark/GFM's output
    # where the page agrees with it (a newline is a <br>, code blocks have a bar, non-http(s) links are text)
    ("a *b* **c** ***d*** ~~e~~ `f`", "<p>a <em>b</em> <strong>c</strong> <strong><em>d</em></strong> <del>e</del> "
     "<code>f</code></p>"),
    ("2 * 3 * 4 and snake_case_name", "<p>2 * 3 * 4 and snake_case_name</p>"),
    ("line one\nline two\n\npara", "<p>line one<br>line two</p><p>para</p>"),
    ("<b>x</b> & \"q\"", "<p>&lt;b&gt;x&lt;/b&gt; &amp; \"q\"</p>"),
    ("\\*not em\\*", "<p>*not em*</p>"),
    ("see https://example.com/x).", '<p>see <a href="https://example.com/x" target="_blank" '
     'rel="noopener noreferrer nofollow">https://example.com/x</a>).</p>'),
    ("[x](ftp://h/f) [y](data:text/html,hi)", "<p>x y</p>"),
    ("3. c\n4. d", '<ol start="3"><li>c</li><li>d</li></ol>'),
    ("> quoted\n\n---", "<blockquote><p>quoted</p></blockquote><hr>"),
    ("| a | b |\n|---|--:|\n| 1 | 2 |", '<div class="table"><table><thead><tr><th>a</th><th style="text-align: right;">'
     'b</th></tr></thead><tbody><tr><td>1</td><td style="text-align: right;">2</td></tr></tbody></table></div>'),
    ("```\nopen fence, still streaming", '<div class="code-block"><div class="code-bar"><span></span><button '
     'class="copy" type="button">Copy</button></div><pre><code>open fence, still streaming</code></pre></div>'),
    ("```js onclick=x\n<i>\n```", '<div class="code-block"><div class="code-bar"><span>js</span><button '
     'class="copy" type="button">Copy</button></div><pre><code class="language-js">&lt;i&gt;</code></pre></div>'),
]


def test_markdown_renderer_cases(srv: ServerProc, browser: Any) -> None:
    _open(browser, srv)
    got = browser.execute_script("""return arguments[0].map((text) => {
        const div = document.createElement('div');
        div.appendChild(Markdown.render(text));
        return div.innerHTML;
      });""", [md for md, _ in MARKDOWN_CASES])
    assert got == [html for _, html in MARKDOWN_CASES]


def test_markdown_of_many_unclosed_openers_renders_in_linear_time(srv: ServerProc, browser: Any) -> None:
    _open(browser, srv)
    # Openers that never close, in one paragraph (rendered again every frame while an answer streams), and a URL
    # with 40k unbalanced ")": a scan from each opener (or ")") to the end took 2-10 s each here; linear work takes
    # milliseconds. A coarse bound, not a benchmark.
    ms = browser.execute_script("""const out = [];
      for (const text of ['*a '.repeat(20000), '_a '.repeat(20000), '**a '.repeat(20000), '~~a '.repeat(20000),
                          '[a '.repeat(40000), 'http://a.b/' + ')'.repeat(40000)]) {
        const t0 = performance.now();
        const div = document.createElement('div');
        div.appendChild(Markdown.render(text));
        out.push([performance.now() - t0, div.textContent.length / text.length]);
      }
      return out;""")
    assert all(kept > 0.7 for _, kept in ms), ms  # rendered (in "**a **a" a single "*" pairs: "*a " in italics)
    assert max(t for t, _ in ms) < 2000, ms


FUZZ = r"""const pieces = ['<', '>', 'img', ' src=x onerror=window.__pwned=1', '<script>', '</script>', '*', '**', '_',
  '`', '```', '~~', '[', ']', '(', ')', 'javascript:', 'http://a.b/', 'https://x.y/(z)', '\n', '\n\n', ' ', '    ',
  '- ', '1. ', '> ', '# ', '|', '---', '\\', '&amp;', '"', "'", 'a', 'b c', '<a href=x>', 'data:', '<b>', '\t',
  '[l](', '](', 'javascript:x', '<javascript:x>', '[l](javascript:x)', '[l](https://ok.example/)', 'vbscript:'];
const tags = new Set(['P', 'BR', 'EM', 'STRONG', 'DEL', 'CODE', 'PRE', 'A', 'H1', 'H2', 'H3', 'H4', 'H5', 'H6', 'UL',
  'OL', 'LI', 'BLOCKQUOTE', 'HR', 'TABLE', 'THEAD', 'TBODY', 'TR', 'TH', 'TD', 'DIV', 'SPAN', 'BUTTON']);
const attrs = new Set(['href', 'target', 'rel', 'class', 'style', 'start', 'type']);
let seed = 7;
const rnd = (n) => { seed = (seed * 1103515245 + 12345) % 2147483648; return seed % n; };
const bad = [];
let links = 0;
for (let t = 0; t < 3000 && bad.length < 5; t++) {
  let text = '';
  for (let k = rnd(40); k >= 0; k--) text += pieces[rnd(pieces.length)];
  const div = document.createElement('div');
  try { div.appendChild(Markdown.render(text)); } catch (e) { bad.push([text, String(e)]); continue; }
  links += div.querySelectorAll('a').length;
  for (const node of div.querySelectorAll('*')) {
    const names = node.getAttributeNames().filter((a) => !attrs.has(a));
    if (!tags.has(node.nodeName) || names.length || (node.nodeName === 'A' && !/^https?:$/.test(node.protocol)))
      bad.push([text, node.outerHTML]);
  }
}
return [links > 100, bad];"""


def test_markdown_of_random_hostile_text_builds_only_safe_nodes(srv: ServerProc, browser: Any) -> None:
    _open(browser, srv)
    # no exception, no element or attribute outside the renderer's own, only http(s) links (and some links made)
    assert browser.execute_script(FUZZ) == [True, []]
    assert browser.execute_script("return window.__pwned") is None


def test_split_panel_shows_critical_share_and_histogram(make_split, tmp_path: Path, browser: Any) -> None:  # type: ignore[no-untyped-def]
    _, wq, wr = make_split("qwen3moe")
    s = ServerProc(wq, "--residual", str(wr), "-r", "1", "-t", "1", "-c", "1024", log_path=tmp_path / "split.log")
    try:
        status, _ = s.request("POST", "/completion", {"prompt": "Hello there", "n_predict": 8})
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
