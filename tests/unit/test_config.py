from pathlib import Path

import pytest

from hpcml.config import RunConfig, flatten, load_config
from hpcml.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digits_cnn.yaml"


def test_example_loads_and_overrides_apply():
    cfg = load_config(EXAMPLE, ["optim.lr=0.01", "train.max_steps=200", "precision=bf16"])
    assert cfg.optim.lr == 0.01
    assert cfg.train.max_steps == 200
    assert cfg.precision == "bf16"
    assert cfg.model.name == "simple_cnn"


def test_defaults_without_file_are_valid():
    cfg = load_config(None)
    assert isinstance(cfg, RunConfig)
    assert flatten(cfg)["data.batch_size"] == cfg.data.batch_size


def test_unknown_key_names_key_and_allowed_keys():
    with pytest.raises(ConfigError) as e:
        load_config(EXAMPLE, ["optim.lrr=1"])
    msg = e.value.message
    assert "optim.lrr" in msg and "lr" in msg and "weight_decay" in msg
    assert "\n" not in msg


def test_wrong_type_names_key_and_value():
    with pytest.raises(ConfigError) as e:
        load_config(EXAMPLE, ["train.max_steps=many"])
    assert "train.max_steps" in e.value.message and "many" in e.value.message


def test_bad_literal_lists_allowed_values():
    with pytest.raises(ConfigError) as e:
        load_config(EXAMPLE, ["precision=fp8"])
    assert "fp8" in e.value.message and "bf16" in e.value.message


def test_bad_value_range():
    with pytest.raises(ConfigError) as e:
        load_config(EXAMPLE, ["data.batch_size=0"])
    assert "data.batch_size" in e.value.message


def test_unknown_section_in_yaml(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("modle:\n  name: mlp\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert "modle" in e.value.message and str(p) in e.value.message


def test_invalid_yaml_and_missing_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_override_without_equals_and_into_scalar():
    with pytest.raises(ConfigError, match="no '='"):
        load_config(EXAMPLE, ["optim.lr"])
    with pytest.raises(ConfigError, match="holds a value"):
        load_config(EXAMPLE, ["precision.x=1"])
