"""``pagedllm serve``: load the engine, start its thread, serve the app with uvicorn.

One log line on start says the URL, the model, the KV pool (blocks, tokens, bytes) and the attention
kernel. SIGINT / SIGTERM shut down cleanly: every in-flight request is aborted (its stream ends with
an error chunk and ``[DONE]``), uvicorn closes the connections, the engine thread is joined, and
the process exits with 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
from pathlib import Path

import uvicorn
from pydantic import ValidationError

from pagedllm.cli_args import add_option_args, engine_options
from pagedllm.config import describe_error
from pagedllm.engine.async_engine import AsyncEngine
from pagedllm.engine.engine import Engine
from pagedllm.errors import ConfigError
from pagedllm.parallel.launch import build_engine
from pagedllm.server.app import build_app
from pagedllm.server.limits import ServerLimits
from pagedllm.server.metrics import ServerMetrics
from pagedllm.server.serving import ServerContext
from pagedllm.server.timeouts import header_timeout_protocol

log = logging.getLogger("pagedllm.serve")


class _Server(uvicorn.Server):
    """uvicorn, plus: on a shutdown signal, abort every request first so streams end promptly."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine) -> None:
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame) -> None:
        threading.Thread(target=self.engine.shutdown, name="pagedllm-shutdown", daemon=True).start()
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signal after shutting down (the process would die of it): ours is
        # a clean shutdown, so the process exits with 0 instead
        self._captured_signals.clear()


def startup_line(engine: Engine, url: str, model_name: str) -> str:
    stats = engine.kv_cache_stats()
    block_size, per_block = stats["block_size"], engine.kv_spec.bytes_per_block
    return (f"pagedllm serving {model_name} at {url}/v1 | {engine.config.dtype}, quantization "
            f"{engine.config.quantization}, attention {engine.attention_backend} | KV pool {stats['num_blocks']} "
            f"blocks x {block_size} tokens = {stats['num_blocks'] * block_size} tokens, "
            f"{stats['num_blocks'] * per_block / 2**20:.0f} MiB ({stats['kv_layout']}, "
            f"{engine.kv_spec.kv_cache_dtype} KV) | {engine.kernels_line()}")


def uvicorn_config(app, host: str, port: int, limits: ServerLimits | None = None,
                   log_level: str = "warning", root_path: str = "") -> uvicorn.Config:
    """uvicorn's config for ``app``: h11 with the header read timeout (``server/timeouts.py``) on
    asyncio's own event loop (uvloop, which Ray Serve installs, would otherwise be taken: the
    server stays as it was measured and tested); ``root_path``: the prefix a proxy serves it under
    (``--root-path /llm``: ``/llm/v1/...``)."""
    limits = limits or ServerLimits()
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, root_path=root_path,
                          timeout_graceful_shutdown=10, http=header_timeout_protocol(limits.header_timeout_s),
                          loop="asyncio")


def set_chat_template(engine: Engine, template: str) -> None:
    """``--chat-template``: a Jinja file, or the template itself, in place of the model's own (as
    vLLM's flag); before any request, so every render uses it."""
    if engine.tokenizer is None:
        raise SystemExit("--chat-template needs a model with a tokenizer")
    path = Path(template)
    engine.tokenizer.hf.chat_template = path.read_text() if path.is_file() else template


def keys_from_env() -> tuple[str, ...]:
    """``$PAGEDLLM_API_KEY``: one key, or several separated by commas."""
    return tuple(k for k in os.environ.get("PAGEDLLM_API_KEY", "").split(",") if k)


def serve(options: dict, host: str = "127.0.0.1", port: int = 8000, api_keys: tuple[str, ...] = (),
          served_model_name: str | None = None, max_queue: int = 1024, max_body_bytes: int | None = None,
          uvicorn_log_level: str = "warning", limits: ServerLimits | None = None,
          guard_metrics: bool = False, salt_per_key: bool = False, metrics_prefix: str = "pagedllm",
          root_path: str = "", tool_call_parser: str = "hermes", chat_template: str | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_keys = tuple(api_keys) or keys_from_env()
    if salt_per_key and not api_keys:
        raise SystemExit("--cache-salt-per-key needs --api-key (one per tenant)")
    # vLLM's metric names carry the served name; without --served-model-name it is known after
    # the load, so the metrics hook resolves the registry then (the engine runs no request before)
    metrics_ready: list[ServerMetrics] = []
    if served_model_name or metrics_prefix == "pagedllm":
        metrics_ready.append(ServerMetrics(metrics_prefix, served_model_name or options.get("model")))
    # built on the engine thread: the main thread (uvicorn's) never runs a torch parallel region
    async_engine = AsyncEngine(lambda: build_engine(**options), on_output=lambda out: metrics_ready[0]
                               .on_output(out))
    engine = async_engine.engine
    model_name = served_model_name or options.get("model") or engine.model_path.stem
    if not metrics_ready:
        metrics_ready.append(ServerMetrics(metrics_prefix, model_name))
    metrics = metrics_ready[0]
    limits = limits or ServerLimits()
    if chat_template is not None:
        set_chat_template(engine, chat_template)
    ctx = ServerContext(async_engine, model_name, max_queue, metrics,
                        api_keys=api_keys, guard_metrics=guard_metrics,
                        salt_per_key=salt_per_key, limits=limits, tool_call_parser=tool_call_parser)

    app = build_app(ctx, **({"max_body_bytes": max_body_bytes} if max_body_bytes else {}))
    config = uvicorn_config(app, host, port, limits, uvicorn_log_level, root_path)
    server = _Server(config, async_engine)
    log.info(startup_line(engine, f"http://{host}:{port}", model_name))
    try:
        server.run()
    finally:
        async_engine.shutdown()
    return 0


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """``pagedllm serve``'s flags: the server's own, then one per engine option."""
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                   help="local .gguf file or HF folder (same as --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback by default)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize and /dashboard/state; "
                        "repeat for several keys, one per tenant (default: $PAGEDLLM_API_KEY, comma-separated, "
                        "else no key)")
    p.add_argument("--cache-salt-per-key", action="store_true",
                   help="salt each API key's prefix cache apart: no tenant's request hits (or learns of, through "
                        "cached_tokens or timing) another's cached prefixes")
    p.add_argument("--guard-metrics", action="store_true", help="with --api-key, guard /metrics too "
                                                                "(open by default, for scrapers, as vLLM's)")
    p.add_argument("--max-prompt-bytes", type=int, default=None,
                   help="refuse prompt text over this many UTF-8 bytes before tokenizing it (default: "
                        "max_model_len x the vocabulary's longest token, in bytes)")
    p.add_argument("--max-logit-bias", type=int, default=1024, help="most logit_bias entries per request")
    p.add_argument("--max-stop", type=int, default=64, help="most stop strings per request")
    p.add_argument("--default-chat-max-tokens", type=int, default=None,
                   help="max_tokens of a chat request that gives none (default: the rest of the context)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a client has to send a request's headers (slow clients are disconnected)")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a client has to send a request's body after its headers (else 408)")
    p.add_argument("--served-model-name", default=None, help="the model name clients send "
                                                             "(default: MODEL, or the model file's name)")
    p.add_argument("--max-queue", type=int, default=1024,
                   help="most requests waiting for a sequence slot; more get 429 with Retry-After")
    p.add_argument("--max-body-bytes", type=int, default=None, help="largest request body (default 8 MiB)")
    p.add_argument("--uvicorn-log-level", default="warning", choices=["critical", "error", "warning", "info"])
    p.add_argument("--metrics-prefix", default="pagedllm", choices=["pagedllm", "vllm"],
                   help="name the /metrics series pagedllm:* (default) or vllm:* with vLLM's model_name label, "
                        "for dashboards built for vLLM")
    p.add_argument("--tool-call-parser", default="hermes", choices=["hermes", "json"],
                   help="how tool_choice 'auto' finds calls in the output: <tool_call> blocks (hermes, as Qwen2.5 "
                        "writes them) or a whole-output JSON call (json)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (a file, or the template itself) in place of the model's")
    p.add_argument("--root-path", default="",
                   help="the path prefix a proxy serves this server under (e.g. /llm), as vLLM's --root-path")
    add_option_args(p)


def options_from_args(args) -> dict:
    """The engine options of a parsed ``serve`` command line (MODEL or ``--model``)."""
    options = engine_options(args)
    if args.model_path is not None:
        if options.get("model") not in (None, args.model_path):
            raise ValueError("give the model once: as MODEL or as --model")
        options["model"] = args.model_path
    return options


def limits_from_args(args) -> ServerLimits:
    try:
        return ServerLimits(max_prompt_bytes=args.max_prompt_bytes, max_logit_bias=args.max_logit_bias,
                            max_stop=args.max_stop, default_chat_max_tokens=args.default_chat_max_tokens,
                            header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout)
    except ValidationError as e:
        raise ConfigError(describe_error(e)) from None


def main(args) -> int:
    """``pagedllm serve``: the engine options and server flags of a parsed command line, served."""
    options, limits = options_from_args(args), limits_from_args(args)
    return serve(options, host=args.host, port=args.port, api_keys=tuple(args.api_key or ()),
                 served_model_name=args.served_model_name, max_queue=args.max_queue,
                 max_body_bytes=args.max_body_bytes, uvicorn_log_level=args.uvicorn_log_level, limits=limits,
                 guard_metrics=args.guard_metrics, salt_per_key=args.cache_salt_per_key,
                 metrics_prefix=args.metrics_prefix, root_path=args.root_path,
                 tool_call_parser=args.tool_call_parser, chat_template=args.chat_template)
