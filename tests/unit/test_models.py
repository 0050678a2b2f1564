import sys
import textwrap

import pytest
import torch

from hpcml.errors import ModelError
from hpcml.models.export import load_export, save_export
from hpcml.models.zoo import build_model, count_parameters, forward_flops_per_sample, get_spec


def test_simple_cnn_has_the_workshop_parameter_count():
    assert count_parameters(build_model("simple_cnn")) == 2_474_506


def test_resnet18_cifar_parameter_count_and_shape():
    model = build_model("resnet18")
    assert count_parameters(model) == 11_173_962  # CIFAR ResNet-18, 10 classes
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_flops_are_counted_and_match_the_analytic_count():
    # Multiply-adds of SimpleCNN on 32x32, by hand: three conv stages and two linear layers.
    macs = (
        32 * 32 * 64 * 3 * 9
        + 16 * 16 * 128 * 64 * 9
        + 8 * 8 * 256 * 128 * 9
        + 4096 * 512
        + 512 * 10
    )
    flops = forward_flops_per_sample(build_model("simple_cnn"), (3, 32, 32))
    assert flops == 2 * macs


def test_mlp_flops_scale_with_width():
    small = forward_flops_per_sample(build_model("mlp", {"hidden": 64}), (3, 32, 32))
    big = forward_flops_per_sample(build_model("mlp", {"hidden": 128}), (3, 32, 32))
    # Exact counts: 2.04x (the first layer, linear in width, dominates the h^2 term).
    assert big > 1.9 * small


def test_user_model_by_import_path(tmp_path, monkeypatch):
    pkg = tmp_path / "mypkg_models_test.py"
    pkg.write_text(
        textwrap.dedent(
            """
            import torch.nn as nn
            def build(num_classes=10):
                return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, num_classes))
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    model = build_model("mypkg_models_test:build", {"num_classes": 3})
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 3)
    sys.modules.pop("mypkg_models_test", None)


def test_unknown_model_and_bad_import_are_one_sentence():
    with pytest.raises(ModelError, match="known models are"):
        get_spec("vgg99")
    with pytest.raises(ModelError, match="cannot be imported"):
        get_spec("no_such_pkg_xyz:build")
    with pytest.raises(ModelError, match="cannot be built"):
        build_model("simple_cnn", {"bogus": 1})


def test_export_round_trip(tmp_path):
    model = build_model("mlp", {"hidden": 32})
    save_export(tmp_path, model, "mlp", {"hidden": 32}, (3, 32, 32), (10,))
    loaded, meta = load_export(tmp_path)
    x = torch.randn(4, 3, 32, 32)
    model.eval()
    assert torch.equal(loaded(x), model(x))
    assert meta["input"]["shape"] == [3, 32, 32] and meta["architecture"] == "mlp"


def test_export_with_corrupt_weights_is_a_clear_error(tmp_path):
    model = build_model("mlp", {"hidden": 32})
    save_export(tmp_path, model, "mlp", {"hidden": 32}, (3, 32, 32), (10,))
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ModelError, match="cannot be loaded"):
        load_export(tmp_path)
