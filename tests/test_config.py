from pathlib import Path

import pytest
import yaml

from omni_rl.config import (
    RECIPE_CONFIGS,
    AdamWConfig,
    DemoConfig,
    SGDConfig,
    config_from_dict,
    load_config,
    save_config,
    to_dict,
)
from omni_rl.errors import ConfigError

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_validates(path):
    cfg = load_config(path)
    assert isinstance(cfg, tuple(RECIPE_CONFIGS.get(n) for n in RECIPE_CONFIGS))


def test_shipped_configs_exist():
    assert {p.name for p in CONFIGS} >= {"demo.yaml", "demo_qwen2_5_vl_7b.yaml"}


def test_defaults_build_without_a_file():
    cfg = load_config(None, recipe="demo")
    assert isinstance(cfg, DemoConfig)
    assert isinstance(cfg.optimizer, AdamWConfig)


def test_unknown_key_names_key_section_and_closest_valid_key():
    with pytest.raises(ConfigError) as err:
        config_from_dict({"recipe": "demo", "trainer": {"stpes": 3}}, source="my.yaml")
    message = str(err.value)
    assert message.startswith("my.yaml: trainer.stpes:")
    assert "unknown key 'stpes' in section 'trainer'" in message
    assert "did you mean 'steps'?" in message


def test_unknown_top_level_section():
    with pytest.raises(ConfigError, match=r"unknown key 'trainr' in the top level \(did you mean 'trainer'\?\)"):
        config_from_dict({"recipe": "demo", "trainr": {}})


def test_wrong_type_names_the_field():
    with pytest.raises(ConfigError, match=r"trainer\.steps: expected an integer, got str 'ten'"):
        config_from_dict({"recipe": "demo", "trainer": {"steps": "ten"}})
    with pytest.raises(ConfigError, match=r"trainer\.steps: expected an integer, got bool"):
        config_from_dict({"recipe": "demo", "trainer": {"steps": True}})
    with pytest.raises(ConfigError, match=r"run\.device: must be one of 'auto', 'cpu', 'cuda', got 'tpu'"):
        config_from_dict({"recipe": "demo", "run": {"device": "tpu"}})
    with pytest.raises(ConfigError, match=r"optimizer\.betas: expected 2 items, got 3"):
        config_from_dict({"recipe": "demo", "optimizer": {"betas": [0.9, 0.9, 0.9]}})


def test_out_of_range_value_names_the_field():
    with pytest.raises(ConfigError, match=r"trainer\.steps: must be >= 1"):
        config_from_dict({"recipe": "demo", "trainer": {"steps": 0}})
    expected = r"model\.tiny_family: unknown family 'qwen2_5vl' \(did you mean 'qwen2_5_vl'"
    with pytest.raises(ConfigError, match=expected):
        config_from_dict({"recipe": "demo", "model": {"tiny_family": "qwen2_5vl"}})


def test_floats_accept_ints_and_exponent_strings():
    cfg = config_from_dict({"recipe": "demo", "optimizer": {"lr": "1e-6"}, "trainer": {"max_grad_norm": 2}})
    assert cfg.optimizer.lr == pytest.approx(1e-6)
    assert cfg.trainer.max_grad_norm == 2.0 and isinstance(cfg.trainer.max_grad_norm, float)


def test_type_key_picks_the_registered_class():
    cfg = config_from_dict({"recipe": "demo", "optimizer": {"type": "sgd", "momentum": 0.5}})
    assert isinstance(cfg.optimizer, SGDConfig)
    assert cfg.optimizer.momentum == 0.5
    with pytest.raises(ConfigError, match=r"optimizer\.type: unknown optimizer 'adam' \(did you mean 'adamw'\?\)"):
        config_from_dict({"recipe": "demo", "optimizer": {"type": "adam"}})
    # a field of another choice is unknown here
    with pytest.raises(ConfigError, match=r"optimizer\.momentum: unknown key 'momentum'"):
        config_from_dict({"recipe": "demo", "optimizer": {"type": "adamw", "momentum": 0.5}})


def test_unknown_recipe_and_missing_recipe():
    with pytest.raises(ConfigError, match=r"unknown recipe 'dem' \(did you mean 'demo'\?\)"):
        config_from_dict({"recipe": "dem"})
    with pytest.raises(ConfigError, match="missing 'recipe' key"):
        config_from_dict({"trainer": {}})


def test_overrides_are_typed_and_validated(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("recipe: demo\ntrainer:\n  steps: 3\n")
    cfg = load_config(path, ["trainer.steps=7", "optimizer.lr=0.5", "run.threads=2", "model.path=/x/y"])
    assert cfg.trainer.steps == 7
    assert cfg.optimizer.lr == 0.5
    assert cfg.run.threads == 2
    assert cfg.model.path == "/x/y"
    with pytest.raises(ConfigError, match=r"trainer\.stpes: unknown key 'stpes'"):
        load_config(path, ["trainer.stpes=7"])
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(path, ["trainer.steps"])
    with pytest.raises(ConfigError, match=r"'trainer\.steps' is not a section"):
        load_config(path, ["trainer.steps.x=1"])


def test_invalid_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("recipe: demo\ntrainer:\n  steps: [1,\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: invalid YAML \(line \d+\)"):
        load_config(path)
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["optimizer.type=sgd", "trainer.steps=4", "video.direction=up"], recipe="demo")
    path = save_config(cfg, tmp_path / "run" / "config.yaml")
    data = yaml.safe_load(path.read_text())
    assert data["recipe"] == "demo"
    assert data["optimizer"]["type"] == "sgd"
    assert load_config(path) == cfg
    assert to_dict(load_config(path)) == to_dict(cfg)
