"""Server-wide chat flags as llama-server has them: `--no-jinja` (llama.cpp's built-in formats), `--reasoning`,
`--reasoning-format`, `--chat-template-kwargs`, and the refusals of flags that cannot work together.

References: the formats as llama.cpp's src/llama-chat.cpp writes them (DeepSeek-3 for the tiny model's
DeepSeek-R1 template, Command-R for the built-in name; the latter string is the one llama.cpp's own server test
expects), the vendored model templates' `enable_thinking` endings (the upstream suite's test_template), and the
native /completion of the same prompt for what the chat route generates.
"""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from server_proc import ServerProc
from testkit import GREEDY, ROOT

TEMPLATES = ROOT / "vendor" / "llama.cpp" / "models" / "templates"
USER, ASSISTANT = "<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>"  # DeepSeek's full-width bars
HI = [{"role": "system", "content": "You are a test."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def servers(tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., ServerProc]]:
    started: dict[tuple[str, ...], ServerProc] = {}
    logs = tmp_path_factory.mktemp("server")

    def get(*flags: str) -> ServerProc:
        if flags not in started:
            started[flags] = ServerProc(tiny_qwen, "--parallel", "1", "-c", "1024", "-t", "1", *flags,
                                        log_path=logs / f"modes{len(started)}.log")
        return started[flags]

    yield get
    for s in started.values():
        s.stop()


def _ok(s: ServerProc, path: str, body: dict[str, Any]) -> Any:
    status, r = s.request("POST", path, body)
    assert status == 200, r
    return r


def _prompt(s: ServerProc, messages: list[dict[str, Any]], **body: Any) -> str:
    return str(_ok(s, "/apply-template", {"messages": messages, **body})["prompt"])


def test_no_jinja_uses_the_builtin_format(servers: Callable[..., ServerProc]) -> None:
    """The tiny model's template is DeepSeek-R1's: without Jinja llama.cpp writes its DeepSeek-3 format (system
    text first, no BOS text, no `<think>`); content parts are joined by newlines."""
    s = servers("--no-jinja")
    assert _prompt(s, HI) == f"You are a test.\n\n{USER}Hi there{ASSISTANT}"
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "it"}]}]
    assert _prompt(s, parts) == f"{USER}What is\nit{ASSISTANT}"
    assert _prompt(s, HI, add_generation_prompt=False) == f"You are a test.\n\n{USER}Hi there"


def test_no_jinja_builtin_template_name(servers: Callable[..., ServerProc]) -> None:
    s = servers("--no-jinja", "--chat-template", "command-r")
    assert _prompt(s, HI) == ("<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a test.<|END_OF_TURN_TOKEN|>"
                              "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|>"
                              "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>")


def test_no_jinja_answers_content(servers: Callable[..., ServerProc]) -> None:
    """The whole answer is `content` (no reasoning split), the same text /completion generates for the rendered
    prompt; Anthropic's route answers it as one text block."""
    s = servers("--no-jinja")
    msgs = [{"role": "user", "content": "Hi there"}]
    chat = _ok(s, "/v1/chat/completions", {"messages": msgs, "max_tokens": 8, **GREEDY})
    msg = chat["choices"][0]["message"]
    ref = _ok(s, "/completion", {"prompt": _prompt(s, msgs), "n_predict": 8, **GREEDY})["content"]
    assert msg["content"] == ref and "reasoning_content" not in msg
    assert chat["usage"]["prompt_tokens"] == _ok(s, "/completion", {"prompt": _prompt(s, msgs),
                                                                     "n_predict": 0})["tokens_evaluated"]
    anth = _ok(s, "/v1/messages", {"messages": msgs, "max_tokens": 8, **GREEDY})
    assert [b["type"] for b in anth["content"]] == ["text"] and anth["content"][0]["text"] == ref


@pytest.mark.parametrize("body,msg", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools param requires --jinja"),
    ({"tool_choice": "required"}, "tool_choice param requires --jinja"),
])
def test_no_jinja_refuses_tools(servers: Callable[..., ServerProc], body: dict[str, Any], msg: str) -> None:
    s = servers("--no-jinja")
    status, r = s.request("POST", "/v1/chat/completions", {"messages": HI, **body})
    assert status == 400 and msg in r["error"]["message"], r


@pytest.mark.parametrize("template,reasoning,end", [
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "on", "<think>\n"),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "off", "<think>\n</think>"),
    ("Qwen-Qwen3-0.6B", "auto", "<|im_start|>assistant\n"),
    ("Qwen-Qwen3-0.6B", "off", "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
])
def test_reasoning_flag_sets_enable_thinking(servers: Callable[..., ServerProc], template: str, reasoning: str,
                                             end: str) -> None:
    """--reasoning on|off is the templates' `enable_thinking` for every request (the endings llama.cpp's
    test_template expects); a request's chat_template_kwargs still overrides it."""
    s = servers("--reasoning", reasoning, "--chat-template-file", str(TEMPLATES / f"{template}.jinja"))
    msgs = [{"role": "user", "content": "What is today?"}]
    assert _prompt(s, msgs).endswith(end)
    if reasoning == "off":
        assert not _prompt(s, msgs, chat_template_kwargs={"enable_thinking": True}).endswith(end)


def test_chat_template_kwargs_flag(servers: Callable[..., ServerProc]) -> None:
    s = servers("--chat-template-kwargs", '{"enable_thinking": false}', "--chat-template-file",
                str(TEMPLATES / "Qwen-Qwen3-0.6B.jinja"))
    assert _prompt(s, HI).endswith("<think>\n\n</think>\n\n")


def test_reasoning_format_none_leaves_thoughts_in_content(servers: Callable[..., ServerProc]) -> None:
    """The tiny model's prompt ends inside `<think>`: by default the answer is reasoning_content; with
    --reasoning-format none it is content, the same text; a request's reasoning_format overrides the flag."""
    msgs = [{"role": "user", "content": "Hi there"}]
    body = {"messages": msgs, "max_tokens": 8, **GREEDY}
    split = _ok(servers(), "/v1/chat/completions", body)["choices"][0]["message"]
    s = servers("--reasoning-format", "none")
    whole = _ok(s, "/v1/chat/completions", body)["choices"][0]["message"]
    assert split["reasoning_content"] and not split.get("content")
    # the split strips the reasoning's surrounding whitespace, as llama.cpp's parser does
    assert whole["content"].strip() == split["reasoning_content"] and "reasoning_content" not in whole
    again = _ok(s, "/v1/chat/completions", {**body, "reasoning_format": "deepseek"})["choices"][0]["message"]
    assert again["reasoning_content"] == split["reasoning_content"]


@pytest.mark.parametrize("flags,msg", [
    (["--strict-model", "--any-model"], "contradict"),
    (["--reasoning-format", "deepseek-legacy"], "deepseek-legacy"),
    (["--reasoning", "maybe"], "expected on, off or auto"),
    (["--chat-template-kwargs", "[1]"], "must be a JSON object"),
    (["--chat-template-kwargs", "{"], "not valid JSON"),
    (["--no-jinja", "--chat-template", "{{ messages }}"], "no built-in format"),
])
def test_refused_at_start(tiny_qwen: Path, flags: list[str], msg: str) -> None:
    r = subprocess.run([sys.executable, "-m", "rapidmoe.cli", "serve", str(tiny_qwen), "--port", "0", "-t", "1",
                        *flags], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and msg in r.stdout + r.stderr, (r.stdout, r.stderr)
