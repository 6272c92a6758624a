"""TrainConfig sources: defaults < YAML file < TIGANA_* environment < flags; bad values name their field."""

from __future__ import annotations

import argparse

import pytest

from tigana.trainer.config import ConfigError, TrainConfig, add_arguments, config_from_args, load_config


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_precedence(tmp_path) -> None:
    path = tmp_path / "train.yaml"
    path.write_text("model: dlrm\nbatch-size: 64\nepochs: 3\nps: [a:1, b:2]\nprefetch: false\n")
    env = {"TIGANA_EPOCHS": "5", "TIGANA_LR": "0.01", "TIGANA_MAX_STEPS": "none"}
    config = config_from_args(_args("--config", str(path), "--epochs", "7", "--fuse-tables"), env)
    assert config.model == "dlrm" and config.batch_size == 64  # file
    assert config.lr == 0.01                                   # environment over default
    assert config.epochs == 7                                  # flag over environment over file
    assert config.ps == ("a:1", "b:2") and config.prefetch is False and config.fuse_tables is True
    assert config_from_args(_args(), {}) == TrainConfig()
    assert load_config(None, {"ps": "h:1,h:2"}, {}).ps == ("h:1", "h:2")


@pytest.mark.parametrize(("text", "env", "field"), [
    ("batch_size: many\n", {}, "batch_size"),
    ("bogus: 1\n", {}, "bogus"),
    ("- a\n", {}, "mapping"),
    ("", {"TIGANA_STALENESS": "-1"}, "staleness"),
    ("", {"TIGANA_PREFETCH": "maybe"}, "prefetch"),
    ("model: transformer\n", {}, "model"),
    ("ps: [nohost]\n", {}, "ps"),
    ("resume: latest\n", {}, "resume"),
])
def test_bad_values_name_the_field(tmp_path, text, env, field) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=field):
        load_config(path, {}, env)


def test_publish_every_takes_steps_or_seconds_and_publishing_needs_a_served_format() -> None:
    from tigana.trainer.config import publish_interval

    assert publish_interval("100") == (100, None) and publish_interval("30s") == (None, 30.0)
    assert publish_interval("0.5s") == (None, 0.5)
    for bad in ("0", "-3", "0s", "ten", "s", ""):
        assert publish_interval(bad) is None, bad
    with pytest.raises(ConfigError, match="publish_every"):
        TrainConfig(publish_dir="x", publish_every="often")
    with pytest.raises(ConfigError, match="publish_dir"):
        TrainConfig(dataset="movielens-100k", data="d", publish_dir="x")
    assert TrainConfig(publish_dir="x", publish_every="2s").publish_keep == 20  # the publish log keeps 20 versions


def test_unseen_takes_the_values_tigana_serve_takes(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("unseen: 0.5\n")  # a YAML number
    assert load_config(path, {}, {}).unseen == "0.5"
    assert config_from_args(_args("--unseen", "initial"), {}).unseen == "initial"
    assert load_config(None, {}, {"TIGANA_UNSEEN": "-1"}).unseen == "-1" and TrainConfig().unseen == "zeros"
    for bad in ("mean", "nan", "often"):
        with pytest.raises(ConfigError, match=f"unseen: must be 'zeros', 'initial' or a finite number, got '{bad}'"):
            TrainConfig(unseen=bad)
