"""Token files that name their clients, and whose a session is ([Note: who a caller is])."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tierflow.errors import InputError, UsageError
from tierflow.transport.callers import MAX_BEHALF_BYTES, owner_of
from tierflow.transport.security import Security, TokenTable


def test_a_token_file_lists_named_clients_and_keeps_a_one_word_line_a_token() -> None:
    table = TokenTable.parse(b"# the clients\nalice tok-a\n\n  bob   tok-b  \nshared-tok\n")
    assert table.entries == (("alice", b"tok-a"), ("bob", b"tok-b"), (None, b"shared-tok"))
    assert table.match(b"Bearer tok-b") == (True, "bob")
    assert table.match(b"Bearer shared-tok") == (True, None)
    for wrong in (b"", b"Bearer tok-", b"Bearer tok-a ", b"tok-a", b"Bearer alice"):
        assert table.match(wrong) == (False, None)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (b"\n# nothing\n", "found none"),
        (b"alice tok extra\n", "line 1: expected TOKEN or NAME TOKEN"),
        (b"alice t\xc3\xa9\n", "printable ASCII"),
        (b"alice tok-a\nalice tok-b\n", "appears twice"),
        (b"alice tok\nbob tok\n", "appears twice"),
    ],
)
def test_a_bad_token_file_is_refused_with_its_line(text: bytes, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        TokenTable.parse(text, "tokens.txt")


def test_a_client_sends_its_one_token_and_an_edge_its_upstream_one(tmp_path: Path) -> None:
    one = tmp_path / "one"
    one.write_text("s3cret\n")
    named = tmp_path / "named"
    named.write_text("edge-1 s3cret-edge\n")
    clients = tmp_path / "clients"
    clients.write_text("alice tok-a\nbob tok-b\n")
    assert Security(token_file=str(one)).token() == b"s3cret"  # as before
    assert Security(token_file=str(named)).token() == b"s3cret-edge"
    with pytest.raises(UsageError, match="a client sends one token, the file lists 2"):
        Security(token_file=str(clients)).token()
    edge = Security(token_file=str(clients), upstream_token_file=str(named))
    assert edge.upstream().token() == b"s3cret-edge"
    assert edge.tokens() is not None and len(edge.tokens().entries) == 2  # type: ignore[union-attr]
    assert Security(token_file=str(one)).upstream().token() == b"s3cret"


def test_an_owner_is_the_caller_or_whom_it_vouches_for_within_its_own_name() -> None:
    assert owner_of("token:edge-1", "") == "token:edge-1"
    vouched = owner_of("token:edge-1", "peer:ipv4:10.0.0.5:4000")
    assert json.loads(vouched) == ["peer:ipv4:10.0.0.5:4000", "token:edge-1"]
    # Two edges vouching for the same name, and one edge for two, are four owners; and
    # no caller's own name can be made by vouching.
    owners = {owner_of(e, d) for e in ("token:e1", "token:e2") for d in ("peer:a", "peer:b")}
    assert len(owners) == 4
    assert owner_of("cert:CN=x", "a") != owner_of("cert:CN=y", "") and all(
        not o.startswith(("token:", "peer:", "cert:")) for o in owners
    )
    with pytest.raises(InputError, match=f"at most {MAX_BEHALF_BYTES} bytes"):
        owner_of("token:edge-1", "x" * (MAX_BEHALF_BYTES + 1))
