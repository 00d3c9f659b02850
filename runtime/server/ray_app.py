"""A Ray Serve application: the server's FastAPI app in every replica, one Engine each, autoscaled.

    serve run runtime.server.ray_app:build_app max_replicas=4 api_key=KEY
    serve run deploy/ray/serve-config.yaml        # or, on a running cluster: serve deploy ...

The builder's args are ``python -m runtime.serve``'s options, named with ``_`` or ``-`` (``model``,
``draft``, ``max_concurrent``, ``api_key``, ``allowed_hosts`` ...; a flag takes ``true``), and the
deployment's own (``DEPLOYMENT_ARGS``): ``num_replicas`` for a fixed count, else autoscaling between
``min_replicas`` and ``max_replicas`` on ``target_ongoing_requests`` per replica; ``num_cpus`` and
``num_gpus`` per replica. Ray's proxy listens (``http_options`` in the config, or ``serve start``),
so ``host`` and ``port`` are refused here. Each response names the replica that served it in the
``x-dflash-replica`` header.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve import Application
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..serve import engine_from_args, parse_args, settings_from_args
from .app import create_app

DEPLOYMENT_NAME = "DFlashServer"
REPLICA_HEADER = "x-dflash-replica"
DEPLOYMENT_ARGS = ("num_replicas", "min_replicas", "max_replicas", "target_ongoing_requests", "num_cpus", "num_gpus")
PROXY_ARGS = ("host", "port")
DEFAULT_MAX_REPLICAS = 4


class ReplicaHeader:
    """Adds the replica's id to every response's headers, without buffering streams."""

    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.app, self.replica = app, replica

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append(REPLICA_HEADER, self.replica)
            await send(message)

        await self.app(scope, receive, named if scope["type"] == "http" else send)


def serve_argv(options: Mapping[str, Any]) -> list[str]:
    """``{"api_key": "k", "allowed_hosts": ["a", "b"], "enable_docs": "true"}`` as the CLI's argv."""
    argv: list[str] = []
    for key, value in options.items():
        if key in PROXY_ARGS:
            raise ValueError(f"{key!r}: Ray Serve's proxy listens for the app; set http_options.{key} in the "
                             "config (or serve start --http-{key}); the accepted Host names are allowed_hosts")
        flag = "--" + key.replace("_", "-")
        if str(value).lower() in ("true", "false"):  # a CLI flag: ``serve run`` passes every value as a string
            argv += [flag] if str(value).lower() == "true" else []
        else:
            argv += [flag, *map(str, value if isinstance(value, (list, tuple)) else [value])]
    return argv


def parse_serve_args(argv: list[str]) -> argparse.Namespace:
    try:
        return parse_args(argv)
    except SystemExit:  # argparse has printed why
        raise ValueError(f"invalid options {argv} (python -m runtime.serve --help lists them)") from None


def replica_app(argv: list[str]) -> FastAPI:
    """In a replica: its own Engine behind the server's app. The options are parsed here again, so an
    option read from the environment ($DFLASH_API_KEY) is the replica's."""
    args = parse_serve_args(argv)
    app = create_app(engine_from_args(args), settings_from_args(args))
    app.add_middleware(ReplicaHeader, replica=serve.get_replica_context().replica_id.unique_id)
    return app


def deployment_options(args: Mapping[str, Any], server: argparse.Namespace) -> dict[str, Any]:
    if "num_replicas" in args:
        replicas: dict[str, Any] = {"num_replicas": int(args["num_replicas"])}
    else:
        # a replica is full when all its generation slots run; more ongoing requests than that wait in its queue
        target = float(args.get("target_ongoing_requests", server.max_concurrent))
        replicas = {"autoscaling_config": {"min_replicas": int(args.get("min_replicas", 1)),
                                           "max_replicas": int(args.get("max_replicas", DEFAULT_MAX_REPLICAS)),
                                           "target_ongoing_requests": target}}
    # Ray sends a replica no more than its app admits (running + queued); beyond, requests wait in Ray's router
    return {**replicas, "max_ongoing_requests": server.max_concurrent + server.max_queue,
            "ray_actor_options": {"num_cpus": float(args.get("num_cpus", 1)), "num_gpus": float(args.get("num_gpus", 0))}}


def server_argv(args: Mapping[str, Any]) -> list[str]:
    """The builder's args less the deployment's, as ``python -m runtime.serve``'s argv."""
    return serve_argv({k: v for k, v in args.items() if k not in DEPLOYMENT_ARGS})


def build_app(args: dict[str, Any]) -> Application:
    """The application ``serve run``/``serve deploy`` names: ``runtime.server.ray_app:build_app``."""
    argv = server_argv(args)
    server = parse_serve_args(argv)  # a wrong option fails here at once, not in every replica

    def asgi_app() -> FastAPI:  # Ray calls this in each replica as it starts (the Engine loads there)
        return replica_app(argv)

    ingress = serve.ingress(asgi_app)()
    return serve.deployment(ingress, name=DEPLOYMENT_NAME, **deployment_options(args, server)).bind()
