"""``tigana train`` as a user runs it: YAML config + flags, 2 trainer processes, an embedded local cluster,
a JSON result as the last stdout line, then a resume from the checkpoint it wrote."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

KEYS = {"auc", "logloss", "samples_per_s", "steps", "eval_rows"}


def _tigana(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tigana.tools.cli", *args], capture_output=True, text=True,
                          timeout=240)


def _last_json(out: subprocess.CompletedProcess) -> dict:
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert set(result) >= KEYS, result
    return result


@pytest.mark.timeout(300)
def test_train_two_processes_then_resume(tmp_path) -> None:
    config = tmp_path / "train.yaml"
    config.write_text("model: dcn_v2\ndataset: synthetic\nsynthetic-rows: 4000\nsynthetic_vocab: 500\n"
                      "batch_size: 999\nepochs: 1\nprogress: false\n")
    ckpt = tmp_path / "ckpt"
    out = _tigana("train", "--config", str(config), "--model", "deepfm", "--batch-size", "250", "--nproc", "2",
                  "--checkpoint-dir", str(ckpt), "--logdir", str(tmp_path / "tb"), "--sparse-aggregation")
    first = _last_json(out)
    # 4000 rows over 2 ranks in batches of 250 (the flag beat the file's 999): 8 steps per rank
    assert first["steps"] == 8 and first["world_size"] == 2 and first["model"] == "deepfm"
    assert first["train_rows"] == 4000 and first["eval_rows"] == 800
    assert 0.0 <= first["auc"] <= 1.0 and first["logloss"] > 0 and first["samples_per_s"] > 0
    assert (ckpt / "step-000000008" / "meta.json").is_file()
    assert any((tmp_path / "tb").iterdir())

    out = _tigana("train", "--config", str(config), "--model", "deepfm", "--batch-size", "250", "--nproc", "2",
                  "--checkpoint-dir", str(ckpt), "--resume", "--epochs", "2")
    second = _last_json(out)
    assert second["steps"] == 16 and second["resumed_from"].endswith("step-000000008")
    assert second["train_rows"] == 4000  # only the second epoch ran in this process


def test_bad_flags_and_config_are_refused(tmp_path, capsys) -> None:
    """In process (``cli.main``, the console script's entry): each is refused before any process starts."""
    from tigana.tools import cli

    def train(*args: str) -> tuple[int, str]:
        code = cli.main(["train", *args])
        return code, capsys.readouterr().err

    bad = tmp_path / "bad.yaml"
    bad.write_text("batch_sise: 10\n")
    code, err = train("--config", str(bad))
    assert code == 2 and "batch_sise" in err
    code, err = train("--epochs", "0")
    assert code == 2 and "epochs" in err
    # missing data or checkpoint: refused with the path named, before any shard or trainer process starts
    missing = tmp_path / "no-such-data"
    code, err = train("--dataset", "criteo", "--data", str(missing))
    assert code == 2 and str(missing) in err and "Traceback" not in err
    assert "local cluster" not in err and "tigana server" not in err
    code, err = train("--checkpoint-dir", str(tmp_path / "empty-ckpt"), "--resume")
    assert code == 2 and "resume" in err and "Traceback" not in err


def test_demo_finds_movielens_where_the_user_points(tmp_path) -> None:
    from tigana.tools.demo_cmd import find_movielens

    (tmp_path / "ml" / "ml-100k").mkdir(parents=True)
    (tmp_path / "ml" / "ml-100k" / "u1.base").write_text("1\t1\t5\t0\n")
    assert find_movielens(str(tmp_path / "ml")) == tmp_path / "ml"
    assert find_movielens(str(tmp_path / "ml" / "ml-100k")) == tmp_path / "ml"
    empty = tmp_path / "empty"
    empty.mkdir()
    found = find_movielens(str(empty))
    assert found is None or (found / "ml-100k" / "u1.base").is_file()  # falls back to ../shared/data
