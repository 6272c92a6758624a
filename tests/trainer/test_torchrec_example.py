"""examples/torchrec_dlrm.py, TorchRec's DLRM loop with the PS drop-in, runs a few steps: on seeded synthetic
rows in the Criteo format, and on the bundled head of the Criteo DAC set when ../shared/data has it."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

pytest.importorskip("torchrec", reason="TorchRec is a test dependency (make install)")

ROOT = Path(__file__).resolve().parents[2]
SHARED_DATA = Path(os.environ.get("TIGANA_SHARED_DATA", ROOT.parent / "shared" / "data"))  # as test_data_criteo's
CRITEO_HEAD = SHARED_DATA / "criteo-dac-head2k" / "train_head1999.txt"


def _example():
    spec = importlib.util.spec_from_file_location("torchrec_dlrm", ROOT / "examples" / "torchrec_dlrm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(capsys: pytest.CaptureFixture[str], args: list[str]) -> dict:
    assert _example().main(args) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_example_trains_on_synthetic_criteo_rows(shard_cluster, capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(capsys, ["--servers", ",".join(shard_cluster.addresses), "--steps", "8", "--rows", "512",
                        "--batch-size", "64", "--dim", "8"])
    assert out["steps"] == 8 and out["embeddings"] == "ps"
    assert out["loss_last"] < out["loss_first"]
    assert out["rows"] > 26  # every table got rows on the servers


def test_example_reads_the_criteo_head(shard_cluster, capsys: pytest.CaptureFixture[str]) -> None:
    if not CRITEO_HEAD.exists():
        pytest.skip(f"{CRITEO_HEAD} is absent (never copied into the repository)")
    out = _run(capsys, ["--servers", ",".join(shard_cluster.addresses), "--data", str(CRITEO_HEAD), "--steps", "3",
                        "--batch-size", "64", "--dim", "8"])
    assert out["steps"] == 3 and out["rows"] > 26


def test_hex_categories_parse_as_python_does() -> None:
    import numpy as np

    texts = ["68fd1e64", "0", "a", "ABCDEF12", "7fffffffffffffff", "ffffffffffffffff"]
    got = _example().hex_ids(np.array(texts).astype("S16"))
    assert got.tolist() == [int(t, 16) for t in texts]
