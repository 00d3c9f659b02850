"""``python -m runtime.serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the Engine.

    python -m runtime.serve --port 8000
    curl -s localhost:8000/v1/chat/completions -d '{"model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": "Hi"}]}'
"""

from __future__ import annotations

import argparse

from .engine import MODES, Engine
from .server import ServerSettings, create_app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m runtime.serve", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="target: HF or MLX folder, or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--draft", help="DFlash drafter folder or random:L (default: the bundled drafter)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--block-size", type=int, default=None, help="default speculative block (default: the drafter's)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-concurrent", type=int, default=8, help="generations running at once")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot; beyond: 429")
    p.add_argument("--log", help="JSONL run log (python -m runtime.replay reads it)")
    p.add_argument("--mode", choices=sorted(MODES), default="pipelined")
    p.add_argument("--pad-batches", choices=["auto", "on", "off"], default="auto",
                   help="run batched steps at power-of-two sizes, so few kernel shapes are built (auto: on a GPU)")
    p.add_argument("--served-model-name", default=None, help="model id clients pass (default: the target's name)")
    p.add_argument("--default-max-tokens", type=int, default=256)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = parse_args(argv)
    pad = {"auto": None, "on": True, "off": False}[args.pad_batches]
    engine = Engine.load(args.model, args.draft, mode=args.mode, log=args.log, dtype=args.dtype, pad_batches=pad)
    app = create_app(engine, ServerSettings(model_name=args.served_model_name, max_concurrent=args.max_concurrent,
                                            max_queue=args.max_queue, block_size=args.block_size,
                                            default_max_tokens=args.default_max_tokens))

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            app.state.server.admission.draining = True  # keep-alive connections get 503 from now on
            super().handle_exit(sig, frame)

    DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level="info")).run()


if __name__ == "__main__":
    main()
