"""Which Criteo files a run reads from a ``--data`` folder. The Kaggle DAC download holds ``train.txt``
(label + 13 counts + 26 categories: 40 fields) and an unlabeled ``test.txt`` (39 fields). Taking that
``test.txt`` as the evaluation set crashed after a full epoch (a count read as a label is not 0 or 1) or,
where the first count happened to be 0 or 1, scored the model against counts. The layout is recognised: the
evaluation set is then every 10th row of ``train.txt``; a training file without labels fails before training."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tigana.trainer.config import TrainConfig
from tigana.trainer.data import SyntheticCriteo
from tigana.trainer.data.criteo import format_dac, has_labels
from tigana.trainer.loop import check_inputs, load_data

ROWS = 400


def _dac_lines(start: int, n: int, *, first_count_01: bool = False) -> list[bytes]:
    chunk = SyntheticCriteo(seed=5, block_rows=200).chunk(start, start + n)
    if first_count_01:  # the case that parsed silently: every I1 reads as a valid label
        chunk.ints[:, 0] = np.arange(n) % 2
        chunk.int_missing[:, 0] = False
    return format_dac(chunk).splitlines()


def _kaggle_folder(root: Path, *, first_count_01: bool = False) -> Path:
    root.mkdir()
    (root / "train.txt").write_bytes(b"\n".join(_dac_lines(0, ROWS)) + b"\n")
    unlabeled = [line.split(b"\t", 1)[1] for line in _dac_lines(ROWS, 50, first_count_01=first_count_01)]
    (root / "test.txt").write_bytes(b"\n".join(unlabeled) + b"\n")
    return root


def _config(data: Path) -> TrainConfig:
    return TrainConfig(dataset="criteo", data=str(data), batch_size=64, eval_batch_size=64, progress=False)


def _labels(batches) -> torch.Tensor:
    return torch.cat([b.labels for b in batches])


@pytest.mark.parametrize("first_count_01", [False, True])
def test_the_kaggle_download_evaluates_on_held_out_train_rows(tmp_path: Path, first_count_01: bool) -> None:
    folder = _kaggle_folder(tmp_path / "dac", first_count_01=first_count_01)
    config = _config(folder)
    check_inputs(config)  # the layout is fine: no error
    data = load_data(config)
    assert "test.txt" not in data.description.split("(")[0] and "held out" in data.description
    train_labels = torch.from_numpy(SyntheticCriteo(seed=5, block_rows=200).chunk(0, ROWS).labels).float()
    held_out = _labels(data.eval_batches())
    assert torch.equal(held_out, train_labels[9::10])  # every 10th row of train.txt, with its real labels
    assert len(_labels(data.train_batches(0))) == ROWS - ROWS // 10


def test_a_labelled_evaluation_file_beside_the_training_file_is_used(tmp_path: Path) -> None:
    folder = _kaggle_folder(tmp_path / "dac")
    (folder / "valid.txt").write_bytes(b"\n".join(_dac_lines(ROWS, 30)) + b"\n")
    data = load_data(_config(folder))
    assert data.description == "criteo train.txt / valid.txt"
    assert len(_labels(data.eval_batches())) == 30


def test_training_on_a_file_without_labels_fails_before_training(tmp_path: Path) -> None:
    folder = _kaggle_folder(tmp_path / "dac")
    with pytest.raises(ValueError, match="no click labels.*test.txt"):
        check_inputs(_config(folder / "test.txt"))


def test_has_labels_tells_the_layouts_apart(tmp_path: Path) -> None:
    folder = _kaggle_folder(tmp_path / "dac", first_count_01=True)
    assert has_labels(folder / "train.txt")
    assert not has_labels(folder / "test.txt")  # 39 fields, even where every first field is 0 or 1
    stripped = tmp_path / "stripped.txt"  # labelled rows whose trailing empty fields were cut
    stripped.write_bytes(b"1\t5\t\t3\n0\t\t7\n")
    assert has_labels(stripped)
    no_label_short = tmp_path / "short.txt"
    no_label_short.write_bytes(b"5\t\t3\n\t7\n")  # a first field of 5 or nothing is no label
    assert not has_labels(no_label_short)
    csv_train, csv_test = tmp_path / "train.csv", tmp_path / "test.csv"
    names = [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]
    csv_train.write_text(",".join(["Id", "Label", *names]) + "\n10000000,0,1" + "," * 38 + "\n")
    csv_test.write_text(",".join(["Id", *names]) + "\n60000000,1" + "," * 38 + "\n")
    assert has_labels(csv_train) and not has_labels(csv_test)
