"""Why each upstream server test that passes on stock llama-server still fails on `rapidmoe-cli serve`.

run.py writes the reason beside every such test in results.md; one without a reason here is marked
"not explained", so a new incompatibility cannot hide among the known ones. docs/server.md ("Results of
llama.cpp's server test-suite") lists the same reasons. Each entry: a pattern matched against "file::test" from its
start, and the reason: a feature refused by name, or a known difference.
"""
from __future__ import annotations

import re

KNOWN: list[tuple[str, str]] = [
    (r"test_rerank::", "reranking (`--reranking`): not implemented (a classification head's score; the MoE "
     "language models we serve have none), the flag is refused and `/rerank` answers 501 `not_supported_error` "
     "naming it, llama-server's answer without the flag"),
    (r"test_mcp_servers::|test_tools_builtin::|test_security::test_cors_origins_defaults_to_localhost_with_tools",
     "server-side tools and MCP servers (`--tools`, `--mcp-servers-*`): not implemented, the flags are refused at "
     "start; `/tools` answers 403 `feature_disabled` naming them, llama-server's answer without the flags"),
    (r"test_proxy::|test_security::test_cors_proxy_only", "the web UI's MCP CORS proxy (`--ui-mcp-proxy`): not "
     "implemented, the flag is refused at start; `/cors-proxy` answers 403 `feature_disabled` naming it, "
     "llama-server's answer without the flag"),
    (r"test_security::test_cors_options\[.*-Access-Control-Allow-Methods-", "the CORS preflight lists the methods "
     "this server answers (`GET, HEAD, POST, OPTIONS`); llama-server's default `--cors-methods` lists `DELETE` too, "
     "a method of its router and tools routes, which are not implemented here"),
    (r"test_sleep::", "sleeping when idle (`--sleep-idle-seconds`): not implemented, the flag is refused at start"),
    (r"test_compat_gcp::", "Vertex AI prediction mode (`AIP_MODE=PREDICTION`): not implemented, refused at start "
     "naming it"),
    (r"test_basic::test_server_multiple_addresses", "several `--host` addresses: not implemented, refused at start"),
    (r"test_stream::", "resumable streams (`X-Conversation-Id`, `/v1/stream`): not implemented, a request with the "
     "header and `GET /v1/stream` answer 501 `not_supported_error` naming them"),
    (r"test_kv_keep_only_active::", "idle slots saved to host memory (`--cache-ram`): not implemented, "
     "`rapidmoe-cli serve` refuses the flag at start; the shim drops it so that the file's other test (the feature "
     "off) runs, and this one fails on llama-server's log tag for it"),
    (r"test_completion::test_n_probs_post_backend_sampling", "backend sampling (`--backend_sampling`): not "
     "implemented, the flag is refused at start"),
    (r"test_chat_completion::test_(chat_template$|chat_template_assistant_prefill|verbose_debug)",
     "`verbose` (the `__verbose` debug field): not implemented, refused by name (400)"),
    (r"test_chat_completion::test_chat_template_continue_final_message", "`continue_final_message`: not "
     "implemented (the chat path renders whole turns), refused by name (400)"),
    (r"test_chat_completion::test_return_progress|test_metrics::test_metrics_timings_on_prompt_progress",
     "`return_progress` (prompt progress events): not implemented, refused by name (400)"),
    (r"test_compat_oai_responses::test_responses_stream_with_llama_telemetry", "llama.cpp's telemetry fields on "
     "`/v1/responses`: `return_progress` (prompt progress events) and `timings_per_token` are not implemented "
     "there, refused by name (400)"),
    (r"test_compat_anthropic::test_anthropic_(tool_result_with_image|vision_format_accepted)",
     "image blocks: multimodal input is not implemented, refused by name with a 400 (llama-server without a "
     "projector fails them with a 500, which the tests expect)"),
    (r"test_compat_anthropic::test_anthropic_empty_messages", "an empty `messages`: refused with a 400, as "
     "Anthropic's API refuses it; llama-server renders an empty conversation"),
]


def reason(file: str, test: str) -> str:
    """The known reason for a test that passes on stock and fails on ours, or "" when there is none."""
    key = f"{file}::{test}"
    return next((why for pattern, why in KNOWN if re.match(pattern, key)), "")
