"""The committed protobuf/gRPC modules match what `make proto` generates from the .proto files."""

from pathlib import Path

import pytest

pytest.importorskip("grpc_tools")

from tigana.proto import generate  # noqa: E402


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    written = generate.generate(tmp_path)
    assert written, "protoc produced nothing"
    for fresh in written:
        committed = generate.HERE / fresh.name
        assert committed.exists(), f"{committed.name} is not committed: run `make proto`"
        assert committed.read_text() == fresh.read_text(), f"{committed.name} is stale: run `make proto`"
