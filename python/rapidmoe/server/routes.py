"""The route table: each path's handler, by method. The handlers are in api/, one module per API family:

- api/native.py: llama-server's own routes (/completion, /infill, /health, /models, /props, /slots, /metrics, and
  those of its features not implemented here, refused with its status)
- api/openai.py: /v1/completions, /v1/chat/completions (chat requests take api/chat_path.py)
- api/openai_responses.py: /v1/responses, on the chat path
- api/anthropic.py: /v1/messages, on the chat path
- api/embeddings.py: /v1/embeddings, /embedding(s), and the refused reranking routes
- api/tokens.py: /tokenize, /detokenize, /apply-template
- api/page.py: the chat page and its /rapidmoe/stats

What they share (the request, the answers, prompts to tickets and back) is api/serving.py's.
"""
from __future__ import annotations

from collections.abc import Callable

from .api import anthropic, embeddings, native, openai, openai_responses, page, tokens
from .api.serving import AppState, Reply, Request, Stream

Handler = Callable[[AppState, Request], Reply | Stream]

_TOOLS = native.feature_disabled("server tools and MCP servers (--tools, --mcp-servers-*)")
_CORS_PROXY = native.feature_disabled("the web UI's MCP CORS proxy (--ui-mcp-proxy)")

GET: dict[str, Handler] = {
    **dict.fromkeys(page.WEB_FILES, page.web_file), "/rapidmoe/stats": page.stats,
    "/health": native.health, "/v1/health": native.health, "/models": native.models, "/v1/models": native.models,
    "/props": native.props, "/slots": native.slots, "/metrics": native.get_metrics,
    "/tools": _TOOLS, "/cors-proxy": _CORS_PROXY, "/v1/stream": native.resumable_stream}
POST: dict[str, Handler] = {
    "/completion": native.completion, "/completions": native.completion, "/infill": native.infill,
    "/v1/completions": openai.oai_completions,
    "/chat/completions": openai.chat_completions, "/v1/chat/completions": openai.chat_completions,
    "/chat/completions/input_tokens": openai.chat_input_tokens,
    "/v1/chat/completions/input_tokens": openai.chat_input_tokens,
    "/v1/responses": openai_responses.oai_responses, "/responses": openai_responses.oai_responses,
    "/v1/responses/input_tokens": openai_responses.oai_responses_input_tokens,
    "/responses/input_tokens": openai_responses.oai_responses_input_tokens,
    "/v1/messages": anthropic.anthropic_messages, "/v1/messages/count_tokens": anthropic.anthropic_count_tokens,
    "/embedding": embeddings.embeddings_native, "/embeddings": embeddings.embeddings_native,
    "/v1/embeddings": embeddings.embeddings_oai,
    **dict.fromkeys(("/rerank", "/reranking", "/v1/rerank", "/v1/reranking"), embeddings.rerank),
    "/tokenize": tokens.tokenize, "/detokenize": tokens.detokenize, "/apply-template": tokens.apply_template,
    "/tools": _TOOLS, "/cors-proxy": _CORS_PROXY}
# Routes whose errors (also those of the HTTP layer: auth, limits, loading) are answered in Anthropic's shape.
ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})
