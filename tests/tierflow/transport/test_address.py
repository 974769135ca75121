"""Addresses parsed once, saying what is wrong: ``tierflow probe 127.0.0.1`` has no port."""

from __future__ import annotations

import pytest

from tierflow.cli.main import build_parser, main
from tierflow.errors import UsageError
from tierflow.transport.address import Address, listen_address
from tierflow.transport.security import bind


@pytest.mark.parametrize(
    "text",
    [
        "127.0.0.1:50051",
        "edge.local:1",
        "[::1]:50051",
        "ipv4:10.0.0.5:50052,10.0.0.6:50052",
        "dns:///tierflow-cloud:50052",
        "unix:/run/tierflow.sock",
    ],
)
def test_addresses_grpc_takes_are_kept_as_written(text: str) -> None:
    assert Address.parse(f" {text} ") == Address(text) and str(Address(text)) == text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "127.0.0.1",
            "address '127.0.0.1' has no port: expected HOST:PORT, like '127.0.0.1:50051'",
        ),
        ("[::1]", "has no port"),
        ("::1", "an IPv6 address goes in brackets before the port, like [::1]:50051"),
        (":50051", "has no host"),
        ("edge:0", "the port '0' is not a port number (1-65535)"),
        ("edge:65536", "is not a port number"),
        ("edge:grpc", "the port 'grpc' is not a port number"),
        ("", "expected HOST:PORT"),
        ("a b:1", "expected HOST:PORT"),
        ("dns:", "names no host after its scheme"),
    ],
)
def test_a_bad_address_says_what_is_wrong_with_it(text: str, message: str) -> None:
    with pytest.raises(UsageError) as caught:
        Address.parse(text)
    assert message in str(caught.value)


def test_the_commands_take_typed_addresses() -> None:
    parser = build_parser()
    probe = parser.parse_args(["probe", "127.0.0.1:50051"])
    run = parser.parse_args(["run", "--plan", "p", "--input", "i", "--edge", "[::1]:7"])
    edge = parser.parse_args(["serve", "edge", "--plan", "p", "--upstream", "dns:///c:1"])
    assert probe.address == Address("127.0.0.1:50051") and run.edge == Address("[::1]:7")
    assert edge.upstream == Address("dns:///c:1")


@pytest.mark.parametrize(
    "argv",
    [
        ["probe", "127.0.0.1"],
        ["run", "--plan", "p", "--input", "i", "--edge", "127.0.0.1"],
        ["device", "--plan", "p", "--source", "-", "--edge", "edge"],
        ["serve", "edge", "--plan", "p", "--upstream", "10.0.0.5"],
    ],
)
def test_an_address_without_a_port_is_one_line_before_any_network(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    """Not "cannot reach a tier": gRPC would have taken port 443 and blamed the network."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert ": error: address " in err and "has no port" in err
    assert err.count("\n") == 1 and "reach" not in err


@pytest.mark.parametrize("listen", ["127.0.0.1:99999", "127.0.0.1:115588", "127.0.0.1:65536"])
def test_a_listen_port_beyond_65535_is_refused_not_wrapped(
    capsys: pytest.CaptureFixture[str], listen: str
) -> None:
    """gRPC takes the port modulo 65536: 99999 served on 34463, and 115588 reported 50052
    "in use". The command line refuses it before loading anything; so does the server."""
    assert main(["serve", "cloud", "--plan", "missing/", "--listen", listen]) == 2
    err = capsys.readouterr().err
    assert f"--listen '{listen}': the port" in err and "is not a port number" in err
    assert err.count("\n") == 1
    with pytest.raises(UsageError, match="is not a port number"):
        bind(None, listen, None, "cloud")  # type: ignore[arg-type]  # refused before use


def test_a_listen_port_within_range_is_taken_as_written() -> None:
    assert listen_address(" 127.0.0.1:0 ") == "127.0.0.1:0"
    assert listen_address("[::1]:65535") == "[::1]:65535"
    assert listen_address("unix:/run/tierflow.sock") == "unix:/run/tierflow.sock"
    with pytest.raises(UsageError, match="expected HOST:PORT"):
        listen_address("50051")
