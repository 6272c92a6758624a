"""``tigana demo`` as a user runs it: a local cluster, 2 trainer processes, a summary, every process stopped."""

import json
import subprocess
import sys


def test_demo_on_synthetic_data_end_to_end(tmp_path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tigana.tools.cli", "demo", "--synthetic", "--synthetic-rows", "6000",
         "--epochs", "1", "--no-progress", "--logdir", str(tmp_path / "tb")],
        capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert "local cluster stopped" in out.stdout
    assert "TensorBoard logs:" in out.stdout
    result = json.loads(lines[-1])
    assert 0.0 <= result["auc"] <= 1.0 and result["logloss"] > 0
    assert result["steps"] > 0 and result["eval_rows"] > 0 and result["samples_per_s"] > 0
    assert result["world_size"] == 2
    assert any((tmp_path / "tb").rglob("events.out.tfevents.*")), "no TensorBoard events written"
