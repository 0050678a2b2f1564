"""Meta-device initialisation (issue 10, item 1) on 1 and 2 CPU processes (gloo, torchrun):

- the initial weights (step 0, before any training) are the same on one process and on two
  under ddp, zero3 (with activation checkpointing) and tp=2, for gpt (per-parameter init) and
  simple_cnn (per-module `reset_parameters`, BatchNorm buffers), whatever the global RNG holds;
- `model.init_from` loads a full export into a zero3- and a tp-sharded gpt exactly as one
  process loads it;
- under tp=2 the logits stay vocabulary-sharded and the cross-entropy is loss-parallel, with one
  process's loss and gradient;
- the FLOPs in summary.json are counted on meta: the CNN/MLP numbers are today's, and gpt's
  equal an independent count of its matmuls (see `test_flops_counted_on_meta`).

This file is also the torchrun worker (`python -m torch.distributed.run ... test_meta_init.py`):
one launch of 2 processes runs every 2-process scenario and writes rank 0's gathered state.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from hpcml.config import load_config
from hpcml.data.sources.tokens import prepare_pystdlib
from hpcml.distributed.parallel import full_state_dict, local_value, loss_context
from hpcml.distributed.runtime import Runtime, init_runtime, shutdown
from hpcml.models.zoo import build_model, forward_flops_per_sample, get_spec
from hpcml.train.build import build_training_model
from hpcml.train.losses import cross_entropy
from hpcml.train.validate import resolve

pytestmark = [pytest.mark.timeout(600)]

GPT = """
model: {{name: gpt-tiny, args: {{n_layer: 3, d_model: 48, n_head: 4}}}}
data: {{source: tokens, path: {corpus}, seq_len: 33, batch_size: 2, eval_windows: 8}}
train: {{seed: 7}}
"""
# seq_len 33 makes the position table 33 rows: FSDP shards it unevenly (17 + 16).
CNN = """
model: {name: simple_cnn}
data: {source: synthetic, synthetic_samples: 64, batch_size: 4}
train: {seed: 7}
"""
SCENARIOS: dict[str, tuple[str, list[str]]] = {
    "gpt_ddp": ("gpt", ["parallel.strategy=ddp"]),
    "gpt_zero3_ac": ("gpt", ["parallel.strategy=zero3", "train.activation_checkpointing=full"]),
    "gpt_tp": ("gpt", ["parallel.tp=2"]),
    "cnn_ddp": ("cnn", ["parallel.strategy=ddp"]),
    "cnn_zero3_ac": ("cnn", ["parallel.strategy=zero3", "train.activation_checkpointing=full"]),
    "gpt_zero3_from": ("gpt", ["parallel.strategy=zero3", "model.init_from={export}"]),
    "gpt_tp_from": ("gpt", ["parallel.tp=2", "model.init_from={export}"]),
}


def built_state(
    config: Path, overrides: list[str], rt: Runtime, probe: dict[str, Any] | None = None
) -> dict[str, torch.Tensor]:
    """The whole model as set-up leaves it (rank 0; other ranks get {}). With `probe`, also one
    loss and its backward on a fixed batch, and the kind of logits the model returned."""
    cfg = load_config(config, overrides)
    rt = dataclasses.replace(rt, tp=cfg.parallel.tp)
    built = build_training_model(cfg, rt, resolve(cfg, rt.world_size))
    if probe is not None:
        gen = torch.Generator().manual_seed(0)
        x, y = (torch.randint(0, 256, (2, 33), generator=gen) for _ in range(2))
        with loss_context(built.model):
            logits = built.model(x)
            loss = cross_entropy(logits, y)
            loss.backward()
        probe["loss"] = float(local_value(loss))
        probe["logits"] = [type(logits).__name__, str(getattr(logits, "placements", None))]
        probe["local_vocab"] = int(getattr(logits, "_local_tensor", logits).shape[-1])
        head = built.model.lm_head.weight.grad  # type: ignore[union-attr]
        probe["head_grad_norm"] = float(getattr(head, "full_tensor", lambda: head)().norm())
    return {k: v.detach().clone() for k, v in full_state_dict(built.model).items()}


def worker(root: Path) -> None:
    rt = init_runtime("cpu", "gloo", 120.0, 1)
    torch.manual_seed(1000 + rt.rank)  # the global RNG differs per rank: init must not use it
    for name, (family, overrides) in SCENARIOS.items():
        given = [o.format(export=root / "export") for o in overrides]
        probe: dict[str, Any] = {}
        state = built_state(root / f"{family}.yaml", given, rt, probe if name == "gpt_tp" else None)
        if rt.is_main:
            save_file(state, str(root / f"{name}.safetensors"))
            if probe:
                (root / "tp_probe.json").write_text(json.dumps(probe))
    shutdown(rt, clean=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("meta_init")
    prepare_pystdlib(root / "corpus", val_fraction=0.2, max_bytes=200_000)
    (root / "gpt.yaml").write_text(GPT.format(corpus=root / "corpus"))
    (root / "cnn.yaml").write_text(CNN)
    # An export to start from: fresh weights moved away from any initialisation.
    single = built_state(root / "gpt.yaml", [], Runtime(0, 0, 1, 1, torch.device("cpu"), None))
    gen = torch.Generator().manual_seed(3)
    exported = {k: v + torch.randn(v.shape, generator=gen) for k, v in single.items()}
    exported["lm_head.weight"] = exported["emb.tok.weight"]  # tied, as the export writes them
    (root / "export").mkdir()
    save_file({k: v.clone() for k, v in exported.items()}, str(root / "export/model.safetensors"))
    return root


@pytest.fixture(scope="module")
def two_process(root: Path) -> dict[str, dict[str, torch.Tensor]]:
    from tests.conftest import hpcml_env

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [__file__, str(root)]
    out = subprocess.run(cmd, env=hpcml_env(), capture_output=True, text=True, timeout=500)
    assert out.returncode == 0, f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return {name: load_file(str(root / f"{name}.safetensors")) for name in SCENARIOS}


def one_process(root: Path, family: str, *overrides: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(12345)  # unlike every rank of the 2-process run
    rt = Runtime(0, 0, 1, 1, torch.device("cpu"), None)
    return built_state(root / f"{family}.yaml", list(overrides), rt)


def one_process_probe(root: Path, probe: dict[str, Any]) -> None:
    built_state(root / "gpt.yaml", [], Runtime(0, 0, 1, 1, torch.device("cpu"), None), probe)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        # Exactly equal, not only within the 1e-6 the issue asks: the same generator, seeded by
        # (seed, name), draws every tensor, and each rank only slices it (no arithmetic).
        assert torch.equal(got[k], want[k]), f"{k}: max diff {(got[k] - want[k]).abs().max()}"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt_ddp", "gpt_zero3_ac", "gpt_tp", "cnn_ddp", "cnn_zero3_ac"])
def test_initial_weights_do_not_depend_on_layout(
    root: Path, two_process: dict[str, dict[str, torch.Tensor]], name: str
) -> None:
    family = SCENARIOS[name][0]
    want = one_process(root, family)
    assert_same(two_process[name], want)
    if family == "gpt":  # the tied output head survives to_empty (a tensor of its own each)
        assert torch.equal(want["lm_head.weight"], want["emb.tok.weight"])
    # The init is seeded per parameter by train.seed, not by the global RNG: another seed
    # gives other weights (so the equality above is not two copies of a constant).
    other = one_process(root, family, "train.seed=8")
    weights = [k for k in want if k.endswith("weight") and want[k].std() > 0]
    assert all(not torch.equal(other[k], want[k]) for k in weights)


@pytest.mark.slow
def test_tp_cross_entropy_is_loss_parallel(
    root: Path, two_process: dict[str, dict[str, torch.Tensor]]
) -> None:
    """Under tp=2 the logits stay sharded by vocabulary (each rank 128 of 256 columns) and the
    loss-parallel cross-entropy gives one process's loss and head gradient."""
    probe = json.loads((root / "tp_probe.json").read_text())
    assert probe["logits"] == ["DTensor", "(Shard(dim=2),)"] and probe["local_vocab"] == 128
    single: dict[str, Any] = {}
    one_process_probe(root, single)
    # fp32 log-sum-exp over 256 logits in two halves vs one pass: a few ulps (~1e-7 relative).
    assert probe["loss"] == pytest.approx(single["loss"], rel=1e-6)
    assert probe["head_grad_norm"] == pytest.approx(single["head_grad_norm"], rel=1e-5)
    assert single["logits"][0] == "Tensor" and single["local_vocab"] == 256


def test_cnn_buffers_initialised(root: Path) -> None:
    """BatchNorm running statistics come out of `to_empty` uninitialised; reset_parameters
    sets them (mean 0, var 1), as a CPU-built model has them."""
    state = one_process(root, "cnn")
    means = [v for k, v in state.items() if k.endswith("running_mean")]
    variances = [v for k, v in state.items() if k.endswith("running_var")]
    assert means and all(torch.equal(m, torch.zeros_like(m)) for m in means)
    assert all(torch.equal(v, torch.ones_like(v)) for v in variances)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt_zero3_from", "gpt_tp_from"])
def test_init_from_export_into_shards(
    root: Path, two_process: dict[str, dict[str, torch.Tensor]], name: str
) -> None:
    exported = load_file(str(root / "export/model.safetensors"))
    single = one_process(root, "gpt", f"model.init_from={root / 'export'}")
    assert_same(single, exported)  # one process loads the file as written
    assert_same(two_process[name], exported)  # and so does each sharded layout


def test_init_from_shape_mismatch_is_one_sentence(root: Path) -> None:
    from hpcml.errors import ModelError

    cfg = load_config(root / "gpt.yaml", ["model.args.d_model=64", f"model.init_from={root}"])
    with pytest.raises(ModelError, match=r"'emb.tok.weight' has shape \[256, 48\] there"):
        resolve(cfg, 1)


# simple_cnn / resnet18 / mlp: forward_flops_per_sample of the CPU-built model before this
# change (summary.json of merge-try), exact integers.
TODAY = {"simple_cnn": 83_240_960, "resnet18": 1_110_845_440, "mlp": 1_709_056}


def _meta_flops(name: str, args: dict[str, Any]) -> int:
    spec = get_spec(name)
    with torch.device("meta"):
        model = build_model(name, args)
    return forward_flops_per_sample(model, spec.shape_for(args), spec.input_dtype, "meta")


@pytest.mark.parametrize("name", sorted(TODAY))
def test_flops_counted_on_meta_unchanged(name: str) -> None:
    assert _meta_flops(name, {}) == TODAY[name]


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_gpt_flops_counted_on_meta(mlp: str) -> None:
    """On meta, attention is decomposed into matmuls that FlopCounterMode counts; on the CPU the
    fused SDPA kernel has no FLOP formula and was not counted before (so gpt's number grew by
    the attention FLOPs and now matches what the counter gives for CUDA's flash kernel).
    Independent count: 2 FLOPs per weight of every Linear per token, plus QK^T and AV, each
    2 T^2 d per layer for the full T x T matrix."""
    args = {"n_layer": 2, "d_model": 64, "n_head": 4, "max_seq_len": 32, "mlp": mlp}
    t, d, layers = 32, 64, 2
    model = build_model("gpt-tiny", args)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    expected = 2 * linear * t + layers * 2 * (2 * t * t * d)
    assert _meta_flops("gpt-tiny", args) == expected


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
