"""``python -m runtime.serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the Engine.

    python -m runtime.serve --port 8000
    curl -s localhost:8000/v1/chat/completions -d '{"model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": "Hi"}]}'
"""

from __future__ import annotations

import argparse
import os

import mlx.core as mx

from .branches import MAX_BRANCHES
from .cli import new_parser, run_cli
from .engine import MODES, Engine
from .server import ServerSettings, create_app
from .server.app import default_allowed_hosts


GPU_SLOTS = 32  # on a GPU batched rounds keep gaining up to 32 streams (BENCHMARKS.md, session 32: 2.5-3.7x 8's)
CPU_SLOTS = 8  # on a CPU a round's rows cost what they compute: more at once mostly slows each


def default_max_concurrent() -> int:
    return GPU_SLOTS if mx.default_device() == mx.gpu else CPU_SLOTS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = new_parser("python -m runtime.serve", __doc__)
    p.add_argument("--model", help="target: HF or MLX folder, or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--draft", help="DFlash drafter folder or random:L (default: the bundled drafter)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--block-size", type=int, default=None, help="default speculative block (default: the drafter's)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-concurrent", type=int, default=None,
                   help=f"generations running at once (default: {GPU_SLOTS} on a GPU, {CPU_SLOTS} on a CPU)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot; beyond: 429")
    p.add_argument("--log", help="JSONL run log (python -m runtime.replay reads it)")
    p.add_argument("--mode", choices=sorted(MODES), default="pipelined")
    p.add_argument("--branches", type=int, choices=range(1, MAX_BRANCHES + 1), default=1, metavar="K",
                   help="blocks every round drafts and verifies, keeping the one accepted furthest (greedy requests)")
    p.add_argument("--pad-batches", choices=["auto", "on", "off"], default="auto",
                   help="run batched steps at power-of-two sizes, so few kernel shapes are built (auto: on a GPU)")
    p.add_argument("--served-model-name", default=None, help="model id clients pass (default: the target's name)")
    p.add_argument("--default-max-tokens", type=int, default=256)
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds open requests may finish after SIGTERM/SIGINT; then they end with an error "
                        "(a second signal exits at once)")
    p.add_argument("--queue-timeout", type=float, default=60.0,
                   help="seconds a request may wait for a generation slot; then 503 + Retry-After")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, help="larger request bodies get 413")
    p.add_argument("--api-key", default=os.environ.get("DFLASH_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $DFLASH_API_KEY; none: open)")
    p.add_argument("--allowed-hosts", nargs="+", default=None,
                   help="Host header values accepted (default: loopback names when bound to loopback, else any)")
    p.add_argument("--enable-docs", action="store_true", help="serve /docs and /openapi.json")
    p.add_argument("--enable-internal-stats", action="store_true", help="serve /v1/internal/stats")
    args = p.parse_args(argv)
    if args.max_concurrent is None:
        args.max_concurrent = default_max_concurrent()
    return args


def engine_from_args(args: argparse.Namespace) -> Engine:
    """The engine the options name, not yet started (the app's lifespan starts it)."""
    pad = {"auto": None, "on": True, "off": False}[args.pad_batches]
    return Engine.load(args.model, args.draft, mode=args.mode, log=args.log, dtype=args.dtype, pad_batches=pad,
                       branches=args.branches)


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    hosts = args.allowed_hosts if args.allowed_hosts is not None else default_allowed_hosts(args.host)
    return ServerSettings(
        model_name=args.served_model_name, max_concurrent=args.max_concurrent, max_queue=args.max_queue,
        block_size=args.block_size, default_max_tokens=args.default_max_tokens, drain_timeout_s=args.drain_timeout,
        queue_timeout_s=args.queue_timeout, max_body_bytes=args.max_body_bytes, api_key=args.api_key or None,
        allowed_hosts=None if hosts == ["*"] else hosts, enable_docs=args.enable_docs,
        enable_internal_stats=args.enable_internal_stats)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = parse_args(argv)
    app = create_app(engine_from_args(args), settings_from_args(args))

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            if self.should_exit:  # a second signal: stop waiting for anything
                self.force_exit = True
            app.state.server.begin_shutdown()  # keep-alive connections get 503 from now on
            super().handle_exit(sig, frame)

    # uvicorn's own limit is a backstop behind the app's drain, which ends open streams with an error event
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=int(args.drain_timeout) + 5)
    DrainingServer(config).run()


if __name__ == "__main__":
    run_cli(main)
