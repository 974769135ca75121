"""The Kubernetes manifests in ``demos/k8s/``: schema-valid, and consistent with tierflow.

Every document is validated against the Kubernetes OpenAPI schemas that the
``kubernetes-validate`` package ships (offline, strict: unknown fields are errors). The
cloud's ConfigMap holds the TOML file of ``tierflow serve cloud --config``, which must
parse as the real command's options; ports, labels and names must agree across files.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from tierflow.cli.config import apply_config
from tierflow.cli.main import build_parser

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

K8S = Path(__file__).resolve().parents[2] / "demos" / "k8s"
# The oldest Kubernetes these manifests claim (gRPC probes are GA from 1.27).
VERSION = "1.27"


def _documents() -> list[dict[str, Any]]:
    documents = []
    for path in sorted(K8S.glob("*.yaml")):
        documents += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return documents


def _find(kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in _documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


@pytest.mark.parametrize("doc", _documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifest_is_schema_valid(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, VERSION, strict=True)


def test_the_validator_refuses_a_broken_manifest() -> None:
    broken = copy.deepcopy(_find("Deployment", "tierflow-cloud"))
    broken["spec"]["replicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSION, strict=True)
    unknown = copy.deepcopy(_find("Service", "tierflow-cloud"))
    unknown["spec"]["headless"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(unknown, VERSION, strict=True)


def test_the_cloud_config_is_what_serve_cloud_takes(tmp_path: Path) -> None:
    config = tmp_path / "cloud.toml"
    config.write_text(_find("ConfigMap", "tierflow-cloud")["data"]["cloud.toml"])
    parser = build_parser()
    argv = ["serve", "cloud", "--config", str(config)]
    assert apply_config(parser, argv) == config
    args = parser.parse_args(argv)
    assert args.plan is not None and args.metrics_port == 9100
    assert "tierflow-redis:6379" in str(args.cache)

    deployment = _find("Deployment", "tierflow-cloud")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert args.listen == f"0.0.0.0:{ports['grpc']}" and ports["metrics"] == args.metrics_port
    mounts = [mount["mountPath"] for mount in container["volumeMounts"]]
    for path in (args.plan, args.tls_cert, args.tls_key, args.tls_ca):
        assert any(str(path).startswith(mount) for mount in mounts), path
    assert container["readinessProbe"]["grpc"]["port"] == ports["grpc"]


def test_services_select_their_deployments() -> None:
    cloud = _find("Service", "tierflow-cloud")
    assert cloud["spec"]["clusterIP"] == "None"  # headless: the edge sees every replica
    for name in ("tierflow-cloud", "tierflow-redis"):
        labels = _find("Deployment", name)["spec"]["template"]["metadata"]["labels"]
        selector = _find("Service", name)["spec"]["selector"]
        assert selector.items() <= labels.items()
