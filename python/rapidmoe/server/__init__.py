"""`rapidmoe-cli serve`: llama-server's HTTP API (native and OpenAI-style routes) over the RapidMoE engine.

Layers: http (app.py: sockets, auth, limits, logging) -> routes (the table) -> api/ (the handlers, one module per
API family: JSON <-> native types) -> engine (one worker thread, continuous batching of slots as sequences of one
llama context). JSON and chat templates stay above the engine.
"""
from __future__ import annotations

from .app import run_server
from .config import ServerConfig

__all__ = ["ServerConfig", "run_server"]
