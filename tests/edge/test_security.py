"""Mutual TLS, bearer tokens, loopback-only plaintext and the probe's credit, on real tiers."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tierflow.device.client import DeviceClient
from tierflow.edge.probe import probe
from tierflow.errors import TransportError, UsageError
from tierflow.options import RuntimeOptions
from tierflow.rpc import tier_pb2, tier_pb2_grpc
from tierflow.runtime.probe import PROBE_ALLOWANCE
from tierflow.runtime.server import TierServer
from tierflow.transport.security import Security, open_channel
from tierflow.transport.stream_client import channel_options


def server_security(tls: dict[str, Path], **extra: Any) -> Security:
    return Security(
        tls_cert=str(tls["server_cert"]),
        tls_key=str(tls["server_key"]),
        tls_ca=str(tls["ca"]),
        **extra,
    )


def client_security(tls: dict[str, Path], who: str = "client") -> Security:
    return Security(
        tls_cert=str(tls[f"{who}_cert"]), tls_key=str(tls[f"{who}_key"]), tls_ca=str(tls["ca"])
    )


def first_result(plan_dir: Path, edge: str, security: Security | None, feeds: Any) -> Any:
    options = RuntimeOptions(security=security or Security())
    with DeviceClient(plan_dir, edge, options=options, deadline_s=5.0) as client:
        return client.submit(feeds).result()


@pytest.mark.integration
def test_mutual_tls_serves_only_clients_with_a_certificate_of_its_ca(
    tmp_path: Path, rt: Any, tls_files: dict[str, Path]
) -> None:
    split = rt.cnn(tmp_path / "plan")
    feeds = split.sample(1)[0]
    mutual_tls = server_security(tls_files)
    with rt.tiers(split.plan_dir, workers=1, security=mutual_tls) as (edge, _, cloud):
        # Device -> edge -> cloud, every hop mutual TLS: the same answer as the unsplit model.
        good = first_result(split.plan_dir, edge, client_security(tls_files), feeds)
        assert good.ok, good.error
        expected = split.reference(feeds)
        for name, array in expected.items():
            np.testing.assert_array_equal(good.outputs[name], array)

        refused = {
            "plaintext": None,
            "no certificate": Security(tls_ca=str(tls_files["ca"])),
            "another CA's certificate": client_security(tls_files, "rogue"),
        }
        for what, security in refused.items():
            result = first_result(split.plan_dir, edge, security, feeds)
            assert isinstance(result.error, TransportError), what
        # The cloud refuses a plaintext client too, and so do probe and health.
        with pytest.raises(TransportError):
            probe(cloud.address, pings=1, transfers=1, payload_bytes=1, connect_timeout=1.0)
        ok = probe(
            edge,
            pings=1,
            transfers=1,
            payload_bytes=1024,
            security=client_security(tls_files),
        )
        assert ok.link == "device-edge"
        channel = open_channel(cloud.address, client_security(tls_files), channel_options())
        try:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            channel.close()
        channel = grpc.insecure_channel(cloud.address)
        try:
            with pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=2
                )
        finally:
            channel.close()


@pytest.mark.integration
def test_a_token_is_required_on_every_call_but_health(
    tmp_path: Path, rt: Any, tls_files: dict[str, Path]
) -> None:
    split = rt.cnn(tmp_path / "plan")
    feeds = split.sample(2)[0]
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    wrong = tmp_path / "wrong"
    wrong.write_text("s3cret-tokem\n")
    tokens = Security(token_file=str(token))
    with rt.tiers(split.plan_dir, workers=1, security=tokens) as (edge, _, _):
        good = first_result(split.plan_dir, edge, Security(token_file=str(token)), feeds)
        assert good.ok, good.error  # the edge passes its token on to the cloud too
        for security in (None, Security(token_file=str(wrong))):
            bad = first_result(split.plan_dir, edge, security, feeds)
            assert isinstance(bad.error, TransportError)
            assert "UNAUTHENTICATED" in str(bad.error)
        channel = grpc.insecure_channel(edge)
        try:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            channel.close()


def test_security_settings_are_checked(tmp_path: Path, tls_files: dict[str, Path]) -> None:
    with pytest.raises(UsageError, match="go together"):
        Security(tls_cert=str(tls_files["server_cert"]))
    with pytest.raises(UsageError, match="cannot read --tls-ca"):
        Security(tls_ca=str(tmp_path / "missing.pem")).channel_credentials()
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(UsageError, match="--token-file"):
        Security(token_file=str(empty)).token()
    settings = server_security(tls_files, token_file=str(empty))
    assert Security.from_dict(settings.to_dict()) == settings


@pytest.mark.integration
def test_plaintext_beyond_loopback_needs_insecure(tmp_path: Path, rt: Any) -> None:
    split = rt.cnn(tmp_path / "plan")
    cloud = TierServer.from_plan("cloud", split.plan_dir, "0.0.0.0:0")
    with pytest.raises(UsageError, match="--insecure"):
        cloud.start()
    cloud.stop(0)
    insecure = RuntimeOptions(security=Security(insecure=True))
    cloud = TierServer.from_plan("cloud", split.plan_dir, "0.0.0.0:0", options=insecure)
    cloud.start()
    cloud.stop(0)


@pytest.mark.integration
def test_a_probe_is_sent_no_more_than_it_sends(tmp_path: Path, rt: Any) -> None:
    split = rt.cnn(tmp_path / "plan")
    cloud = TierServer.from_plan(
        "cloud", split.plan_dir, "127.0.0.1:0", options=RuntimeOptions(workers=1)
    )
    cloud.start()
    channel = grpc.insecure_channel(cloud.address, options=channel_options())
    try:
        asks = [
            tier_pb2.ProbeMessage(seq=1, reply_bytes=512 * 1024 * 1024),
            tier_pb2.ProbeMessage(seq=2, reply_bytes=1 << 20),
            tier_pb2.ProbeMessage(seq=3, payload=bytes(300_000), reply_bytes=1 << 20),
        ]
        replies = list(tier_pb2_grpc.TierStub(channel).Probe(iter(asks), timeout=10))
        sizes = [len(r.payload) for r in replies]
        # The allowance refills at PROBE_ALLOWANCE per second: a few bytes in between.
        refill = PROBE_ALLOWANCE // 10
        assert sizes[0] == PROBE_ALLOWANCE and sizes[1] < refill
        assert 300_000 <= sizes[2] < 300_000 + refill
    finally:
        channel.close()
        cloud.stop(0)


@pytest.mark.integration
def test_many_probe_streams_from_one_peer_share_one_allowance(tmp_path: Path, rt: Any) -> None:
    """200 streams on one connection, each asking 64 KiB and sending nothing, used to get
    13 MB back for 17 KB sent (issue 20, item 11): the allowance is per peer, not stream."""
    split = rt.cnn(tmp_path / "plan")
    cloud = TierServer.from_plan(
        "cloud", split.plan_dir, "127.0.0.1:0", options=RuntimeOptions(workers=1)
    )
    cloud.start()
    channel = grpc.insecure_channel(cloud.address, options=channel_options())
    stub = tier_pb2_grpc.TierStub(channel)
    try:
        started = time.monotonic()
        calls = [
            stub.Probe(iter([tier_pb2.ProbeMessage(seq=i, reply_bytes=PROBE_ALLOWANCE)]))
            for i in range(200)
        ]
        received = sum(len(reply.payload) for call in calls for reply in call)
        elapsed = time.monotonic() - started
        assert received <= PROBE_ALLOWANCE * (1 + elapsed) + 1
        assert received < 200 * PROBE_ALLOWANCE // 10
    finally:
        channel.close()
        cloud.stop(0)


@pytest.mark.integration
def test_a_second_server_on_a_port_in_use_fails_with_one_line(tmp_path: Path, rt: Any) -> None:
    split = rt.cnn(tmp_path / "plan")
    cloud = TierServer.from_plan(
        "cloud", split.plan_dir, "127.0.0.1:0", options=RuntimeOptions(workers=1)
    )
    cloud.start()
    try:
        second = TierServer.from_plan(
            "cloud", split.plan_dir, cloud.address, options=RuntimeOptions(workers=1)
        )
        with pytest.raises(TransportError, match="in use"):
            second.start()
        second.stop(0)
        command = [sys.executable, "-m", "tierflow.cli", "serve", "cloud"]
        command += ["--plan", str(split.plan_dir), "--listen", cloud.address]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert done.returncode == 1  # a failure while it ran ([Note: exit statuses])
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "in use" in lines[0], done.stderr
    finally:
        cloud.stop(0)


@pytest.mark.integration
def test_the_command_line_serves_and_probes_over_mutual_tls(
    tmp_path: Path, rt: Any, tls_files: dict[str, Path], capsys: Any
) -> None:
    from tierflow.cli.main import main

    split = rt.cnn(tmp_path / "plan")
    server_flags = ["--tls-cert", str(tls_files["server_cert"])]
    server_flags += ["--tls-key", str(tls_files["server_key"]), "--tls-ca", str(tls_files["ca"])]
    client_flags = ["--tls-cert", str(tls_files["client_cert"])]
    client_flags += ["--tls-key", str(tls_files["client_key"]), "--tls-ca", str(tls_files["ca"])]
    probe_args = ["--json", "--pings", "1", "--transfers", "1", "--payload", "1KiB"]
    with rt.processes() as start:
        cloud = start("cloud", split.plan_dir, *server_flags, listen="0.0.0.0:0")
        address = f"127.0.0.1:{cloud.address.rsplit(':', 1)[1]}"
        assert main(["probe", address, *probe_args, *client_flags]) == 0
        assert '"link": "edge-cloud"' in capsys.readouterr().out
        # Plaintext against TLS, a name the certificate does not carry, and nothing
        # listening are three messages, each one line ([Note: reaching a tier first]).
        assert main(["probe", address, *probe_args]) == 1  # a failure while it ran
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "something listens there, but not plaintext gRPC" in err
        wrong_name = [*client_flags, "--tls-server-name", "elsewhere.example"]
        assert main(["probe", address, *probe_args, *wrong_name]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "the TLS handshake failed" in err
        assert "does not name 'elsewhere.example'" in err
