"""Fixtures shared by every test package."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from . import layers


def pytest_configure(config: pytest.Config) -> None:
    _warm_matplotlib()
    layers.install()


def _warm_matplotlib() -> None:
    """Load matplotlib's font list before the fast-test guard is installed.

    matplotlib builds its font cache the first time it is imported with an empty
    ``MPLCONFIGDIR`` (a fresh machine, a fresh CI runner), and building it runs
    ``fc-list``: a process, which the guard (tests/layers.py) would pin on whichever fast
    test happened to import matplotlib first. The cache is the environment's, not the
    test's, so it is built here, once per test process, before any test runs; an
    environment without matplotlib (runtime-only) skips this.
    """
    if importlib.util.find_spec("matplotlib") is not None:
        import matplotlib.font_manager  # noqa: F401  (builds or loads the font cache)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    """A fast test's fixtures may not start things either. See tests/layers.py."""
    return (yield from layers.guarded(item, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    return (yield from layers.guarded(item, "the test"))


@pytest.fixture(autouse=True)
def _peer_warnings_logged_afresh() -> None:
    """Each test sees the first warning about a peer logged, whatever tests warned before it
    in this process ([Note: warnings about a peer] in tierflow/transport/peer_warnings.py)."""
    from tierflow.transport.peer_warnings import WARNINGS

    WARNINGS.forget()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_redis(
    directory: Path, *extra: str, port: int | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """A throw-away redis-server on a free port with no persistence; its URL once it PINGs.

    ``extra`` are more redis-server options (a password, a TLS port); ``port`` a port to
    take instead of a free one. Without the binary the test is skipped, except under CI
    (env ``CI`` set), where a missing service must fail the run rather than pass it silently.
    """
    binary = shutil.which("redis-server")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not installed, and CI must run the Redis tests")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    for _ in range(5):
        chosen = port or _free_port()
        process = subprocess.Popen(
            [
                binary,
                "--port",
                str(chosen),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(directory),
                "--loglevel",
                "warning",
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and process.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", chosen), timeout=0.5) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith((b"+PONG", b"-NOAUTH")):
                        return process, f"redis://127.0.0.1:{chosen}/0"
            except OSError:
                time.sleep(0.02)
        stop_redis(process)  # lost the port race or never came up: try another port
    pytest.fail("redis-server did not answer PING on any of 5 free ports")


def stop_redis(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a real redis-server shared by the session's tests (stopped at the end)."""
    process, url = start_redis(tmp_path_factory.mktemp("redis"))
    try:
        yield url
    finally:
        stop_redis(process)


@pytest.fixture
def redis_servers(tmp_path: Path) -> Iterator[Any]:
    """Start private redis-servers (to stall, stop or configure); each stopped afterwards.

    Call the yielded function as :func:`start_redis` without the directory.
    """
    started: list[subprocess.Popen[bytes]] = []

    def start(*extra: str, port: int | None = None) -> tuple[subprocess.Popen[bytes], str]:
        process, url = start_redis(tmp_path, *extra, port=port)
        started.append(process)
        return process, url

    try:
        yield start
    finally:
        for process in started:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)  # a stalled server must still stop
            stop_redis(process)


@pytest.fixture(scope="session", autouse=True)
def tierflow_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point ``$TIERFLOW_CACHE`` at a fresh folder for the whole run.

    Tests (and the processes they start, which inherit the environment) then never read
    or write the user's ``~/.cache/tierflow``, and the demo model is trained at most once
    per run, by :func:`demo_build`.
    """
    root = tmp_path_factory.mktemp("tierflow-cache")
    previous = os.environ.get("TIERFLOW_CACHE")
    os.environ["TIERFLOW_CACHE"] = str(root)
    yield root
    if previous is None:
        os.environ.pop("TIERFLOW_CACHE", None)
    else:
        os.environ["TIERFLOW_CACHE"] = previous


@pytest.fixture(scope="session")
def demo_build(tierflow_cache: Path) -> tuple[Any, list[Any]]:
    """The demo model, trained once per run into the run's cache, and its epoch reports."""
    from tierflow.zoo import digits

    reports: list[Any] = []
    demo = digits.build_demo_model(progress=reports.append)
    return demo, reports


@pytest.fixture(scope="session")
def byte_family(tierflow_cache: Path) -> Any:
    """The byte decoder family (small, medium, large), trained once per run into the
    run's cache (about a minute); see ``tierflow.zoo.bytelm_family``."""
    from tierflow.zoo.bytelm_family import build_family

    return build_family()


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A throw-away CA, a server and a client certificate signed by it, and a rogue client.

    Keys: ``ca``, ``server_cert``, ``server_key``, ``client_cert``, ``client_key``,
    ``client2_cert``, ``client2_key`` (a second client of the same CA), ``rogue_cert``,
    ``rogue_key`` (the rogue is signed by another CA). The server's
    certificate names 127.0.0.1 and localhost. Needs the ``cryptography`` package (dev).
    """
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory = tmp_path_factory.mktemp("tls")
    now = datetime.datetime.now(datetime.timezone.utc)

    def name(text: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])

    def certificate(
        subject: str,
        key: ec.EllipticCurvePrivateKey,
        issuer: str,
        issuer_key: ec.EllipticCurvePrivateKey,
        *,
        ca: bool,
        server: bool = False,
    ) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(name(issuer))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if server:
            import ipaddress

            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
        if not ca:
            # A tier's certificate also serves as its client certificate to the next tier.
            usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
            if server:
                usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
            builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    def write(stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        (directory / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (directory / f"{stem}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    rogue_ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = "tierflow test CA"
    write("ca", certificate(ca_name, ca_key, ca_name, ca_key, ca=True), ca_key)
    for stem, issuer, issuer_key, server in (
        ("server", "tierflow test CA", ca_key, True),
        ("client", "tierflow test CA", ca_key, False),
        ("client2", "tierflow test CA", ca_key, False),
        ("rogue", "another CA", rogue_ca_key, False),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        write(stem, certificate(stem, key, issuer, issuer_key, ca=False, server=server), key)
    files = {"ca": directory / "ca.pem"}
    for stem in ("server", "client", "client2", "rogue"):
        files[f"{stem}_cert"] = directory / f"{stem}.pem"
        files[f"{stem}_key"] = directory / f"{stem}.key"
    return files
