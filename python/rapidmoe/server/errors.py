"""HTTP API errors with llama-server's body: `{"error": {"code", "message", "type"}}`.

Raised anywhere above the engine; the HTTP layer turns them into the response. Nothing else belongs here.
"""
from __future__ import annotations

import json
from typing import Any


class ApiError(Exception):
    """An error answered to the client; `status` is the HTTP status and the body's `code`."""

    def __init__(self, status: int, type_: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message
        self.extra = extra  # extra fields inside "error", e.g. n_prompt_tokens/n_ctx for exceed_context_size_error

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.status, "message": self.message, "type": self.type, **self.extra}}

    def to_bytes(self) -> bytes:
        return json.dumps(self.body(), ensure_ascii=False).encode()


def invalid_request(message: str) -> ApiError:
    return ApiError(400, "invalid_request_error", message)


def exceed_context(n_prompt_tokens: int, n_ctx: int) -> ApiError:
    return ApiError(400, "exceed_context_size_error",
                    f"the request exceeds the available context size ({n_prompt_tokens} prompt tokens, "
                    f"{n_ctx} per slot), try increasing it",
                    n_prompt_tokens=n_prompt_tokens, n_ctx=n_ctx)


def authentication() -> ApiError:
    return ApiError(401, "authentication_error", "Invalid API Key")


def not_found(message: str) -> ApiError:
    return ApiError(404, "not_found_error", message)


def payload_too_large(limit: int) -> ApiError:
    return ApiError(413, "invalid_request_error", f"request body larger than the limit of {limit} bytes")


def unavailable(message: str) -> ApiError:
    return ApiError(503, "unavailable_error", message)


def server_error(message: str) -> ApiError:
    return ApiError(500, "server_error", message)
