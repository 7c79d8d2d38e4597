"""Server settings: one frozen dataclass built by the CLI and passed down; no module globals."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..placement.cache.config import ExpertCacheConfig


@dataclass(frozen=True)
class ServerConfig:
    model: Path
    host: str = "127.0.0.1"
    port: int = 8080
    aliases: tuple[str, ...] = ()  # model names in the API; the id is the alphabetically first, as llama-server's
    tags: tuple[str, ...] = ()  # informational, listed in /v1/models
    strict_model: bool = False  # a request's "model" must be one of model_names (else 404); by default any name is
    # served, as llama-server does with one model
    parallel: int = 2  # slots decoded together, one llama sequence each
    queue_size: int = -1  # generations waiting for a slot beyond `parallel`; more get 503 at once; -1: no limit
    # (llama-server's queue)
    ctx_size: int = 4096  # total KV cells; each slot gets ctx_size / parallel (llama.cpp rounds up to 256)
    n_batch: int = 512  # tokens per llama_decode (prompt chunks + one per generating slot)
    n_predict: int = -1  # server default when a request gives none; -1: until the slot's context is full
    threads: int | None = None
    n_gpu_layers: int = 0
    n_cpu_moe: int = 0
    # per-expert WQ cache (from --gpu-mem on a GPU machine, its policy from --cache-policy), as rapidmoe.Llama takes it
    expert_cache: ExpertCacheConfig | None = None
    override_tensor: tuple[str, ...] = ()
    rpc_servers: tuple[str, ...] = ()  # llama.cpp's --rpc: host:port of rpc-servers whose devices the model may use
    tensor_split: tuple[float, ...] = ()  # llama.cpp's -ts: offloaded layers per device (empty: by free memory)
    residual: Path | None = None
    n_critical: int = 2
    policy: Path | None = None
    overlap: str = "auto"  # rapidmoe.Llama's overlap mode for split layers
    flash_attn: str = "auto"  # llama.cpp's -fa: auto, on or off (llama-server's default: auto)
    trace: Path | None = None  # routing trace file (rapidmoe.trace), written as batches are decoded
    api_keys: tuple[str, ...] = ()
    cors_origins: str = "*"  # --cors-origins: "*" (any, the request's Origin echoed), "localhost" (a localhost Origin
    # echoed, others get none), else sent as given (llama-server's three cases)
    timeout: float = 600.0  # socket write timeout while answering, seconds (llama-server's --timeout)
    max_connections: int = 128  # open connections (one thread each); more get 503 at once
    header_timeout: float = 10.0  # a request's line and headers must arrive within this, seconds (else 408)
    body_timeout: float = 10.0  # its body must arrive within this after the headers, seconds (else 408)
    keepalive_timeout: float = 5.0  # an idle keep-alive connection is closed after this, seconds
    queue_timeout: float = 600.0  # longest wait for a request's first choice to get a slot before 503, seconds
    max_body: int = 1 << 20  # request body limit, bytes
    chat_template: str | None = None  # Jinja template overriding the GGUF's
    jinja: bool = True  # render chat with the Jinja template; False: llama.cpp's built-in formats (--no-jinja)
    chat_template_kwargs: tuple[tuple[str, Any], ...] = ()  # server-wide template arguments (--chat-template-kwargs,
    # --reasoning on|off as enable_thinking), under each request's chat_template_kwargs
    reasoning_format: str = "auto"  # default reasoning_format of chat requests: auto|deepseek split <think>, none not
    reasoning_budget: int = -1  # default thinking budget of chat requests, tokens (-1: unrestricted; reasoning.py)
    reasoning_budget_message: str = ""  # forced before the end tag when the budget runs out
    embeddings: bool = False  # serve /v1/embeddings and /embedding(s) (llama-server's --embedding)
    pooling: str | None = None  # --pooling: none|mean|cls|last|rank (server/pooling.py); None: the model's
    embd_normalize: int = 2  # --embd-normalize for pooled embeddings: -1 none, 0 max abs, 1 taxicab, 2 euclidean
    seed: int = -1  # default sampling seed (-1: random)
    temperature: float = 0.8  # default sampling temperature
    metrics: bool = True
    ui: bool = True  # the chat page at /
    slots: bool = True
    verbose: bool = False

    @property
    def model_id(self) -> str:
        return min(self.aliases) if self.aliases else str(self.model)

    @property
    def model_names(self) -> tuple[str, ...]:
        """Names a request's "model" may use: the aliases, the path as given, the file name and its stem."""
        return (*self.aliases, str(self.model), self.model.name, self.model.stem)
