"""The config schema under generated input (issue 19): configs drawn from the JSON schema of
`RunConfig` (valid by the schema) and the same configs broken on purpose (a wrong type, an
out-of-range or non-finite number, an unknown key, a section replaced by a value, a huge or
empty string) go through YAML loading and the parent-side validation `hpcml train` runs before
any worker starts (`hpcml.train.validate.resolve`: data description, model on meta, layout).

The property (issue 29): a refused config is refused with an `HpcmlError` of one line and exit
code 2; an accepted config must build what a worker builds before its first step
(`build_like_a_worker`: seeds, the model's forward on meta, optimizer and schedule over the
meta parameters, the loss, the training loader and its first batch) without any exception.
Accepting is not enough: with the numeric bounds of `config.py` removed, schema-valid configs
such as `train.seed: -1` or `optim.betas: [2, 5]` pass `resolve` and crash a worker, and this
test fails.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from conftest import examples
from hpcml.config import RunConfig, load_config
from hpcml.data.loader import EpochLoader
from hpcml.distributed import meta_init
from hpcml.errors import ConfigError, HpcmlError
from hpcml.models.zoo import forward_flops_per_sample
from hpcml.train.losses import resolve_loss
from hpcml.train.schedule import build_optimizer, build_scheduler, param_groups
from hpcml.train.summary import seed_everything
from hpcml.train.validate import Resolved, physical_memory_bytes, resolve

SCHEMA = RunConfig.model_json_schema()


def from_schema(node: dict[str, Any], defs: dict[str, Any] | None = None) -> Any:
    """Values valid under the subset of JSON Schema pydantic writes for `RunConfig` (objects,
    enums, anyOf, arrays, bounded numbers). Written here because hypothesis-jsonschema does not
    run on this Hypothesis version; the subset is small and `test_schema_walker_covers_the_schema`
    fails when pydantic starts writing a keyword it does not know."""
    defs = SCHEMA["$defs"] if defs is None else defs
    if "$ref" in node:
        return from_schema(defs[node["$ref"].split("/")[-1]], defs)
    if "enum" in node:
        return st.sampled_from(node["enum"])
    if "anyOf" in node:
        return st.one_of([from_schema(n, defs) for n in node["anyOf"]])
    kind = node.get("type")
    if kind == "object":
        props = node.get("properties", {})
        if not props:  # free-form mapping (model.args)
            return st.dictionaries(
                st.sampled_from(["hidden", "depth", "num_classes", "n_layer", "dropout", "x"]),
                st.one_of(st.integers(-4, 4096), st.floats(-1, 1), st.text(max_size=4)),
                max_size=3,
            )
        return st.fixed_dictionaries({}, optional={k: from_schema(v, defs) for k, v in props.items()})
    if kind == "integer":
        lo = node.get("minimum", node.get("exclusiveMinimum", -(2**31) - 1) + 1)
        hi = node.get("maximum", node.get("exclusiveMaximum", 2**31 + 1) - 1)
        return st.integers(lo, hi)
    if kind == "number":
        return st.floats(
            node.get("minimum", node.get("exclusiveMinimum", -1e12)),
            node.get("maximum", node.get("exclusiveMaximum", 1e12)),
            exclude_min="exclusiveMinimum" in node,
            exclude_max="exclusiveMaximum" in node,
            allow_nan=False,
        )
    if kind == "boolean":
        return st.booleans()
    if kind == "string":
        return st.text(max_size=20)
    if kind == "null":
        return st.none()
    if kind == "array":
        if "prefixItems" in node:
            return st.tuples(*(from_schema(n, defs) for n in node["prefixItems"])).map(list)
        return st.lists(from_schema(node.get("items", {"type": "integer"}), defs), max_size=4)
    raise AssertionError(f"schema node the walker does not know: {node}")


def test_schema_walker_covers_the_schema() -> None:
    for node in SCHEMA["$defs"].values():
        for prop in node.get("properties", {}).values():
            from_schema(prop)  # raises on an unknown construct
    assert set(SCHEMA["properties"]) == set(RunConfig.model_fields)
SECTIONS = sorted(SCHEMA["properties"])
HOSTILE: list[Any] = [
    "x", "", "é" * 500, -1, 0, 10**30, -(10**30), 1.5, math.nan, math.inf, -math.inf,
    True, None, [], {}, [1, 2], {"a": 1},
]
# Generating a synthetic set is work, not validation: larger ones are refused by the schema
# (see DataConfig) or skipped here, where each example must stay cheap.
SYNTHETIC_ELEMENTS_FOR_FUZZ = 10**6


def one_line(exc: HpcmlError) -> None:
    assert "\n" not in exc.message.strip(), exc.message
    assert "Traceback" not in exc.message
    assert exc.exit_code == 2, (type(exc).__name__, exc.message)  # bad input


def cheap(data: dict[str, Any]) -> bool:
    """Small enough to generate, or so large that validation refuses it without generating."""
    d = data.get("data") or {}
    if not isinstance(d, dict) or d.get("source", "digits") != "synthetic":
        return True
    shape = d.get("synthetic_shape", [3, 32, 32])
    n = int(d.get("synthetic_samples", 4096))
    elements = math.prod(int(s) for s in shape) * n
    return elements <= SYNTHETIC_ELEMENTS_FOR_FUZZ or elements * 8 > (physical_memory_bytes() or 0)


def build_like_a_worker(cfg: RunConfig, res: Resolved) -> None:
    """What `Trainer.setup` builds from the config before its first step, short of a process
    group and storage: any exception here would be a worker's traceback."""
    seed_everything(cfg.train.seed, deterministic=False)
    model = res.meta_model
    if meta_init.initializable(model):
        forward_flops_per_sample(model, res.splits.input_shape, res.splits.input_dtype, "meta")
    # fused=False: the fused kernels take no meta tensors; the checks of the settings are shared.
    optimizer = build_optimizer(param_groups(model, cfg.optim), cfg.optim, res.dp_size, False)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.max_steps)
    for _ in range(min(cfg.train.max_steps, cfg.optim.warmup_steps + 2)):
        scheduler.step()
    resolve_loss(cfg.train.loss)
    loader = EpochLoader(res.splits.train, cfg.data, 0, res.dp_size, cfg.train.seed, False)
    if cfg.data.num_workers == 0:  # a first batch, without starting worker processes
        loader.next()


def load_and_validate(data: dict[str, Any], world_size: int, tmp: Path) -> None:
    path = tmp / "c.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    try:
        cfg = load_config(path)
    except ConfigError as exc:
        one_line(exc)
        return
    try:
        res = resolve(cfg, world_size)
    except HpcmlError as exc:
        one_line(exc)
        return
    build_like_a_worker(cfg, res)


@settings(max_examples=examples(50))
@given(data=from_schema(SCHEMA), world_size=st.sampled_from([1, 2, 3, 4]))
@example(data={"data": {"source": "synthetic", "synthetic_shape": []}}, world_size=1)
@example(data={"model": {"name": "mlp", "args": {"hidden": -3}}}, world_size=1)
@example(data={"data": {"source": "\n"}}, world_size=1)  # found: a two-line sentence
@example(data={"model": {"name": "\n"}}, world_size=1)
# Issue 29: each passed resolve and crashed the workers (a numpy seed, AdamW's betas, a conv
# over an empty input, 1.2 PB of synthetic samples), before the bounds and checks.
@example(data={"train": {"seed": -1}}, world_size=1)
@example(data={"optim": {"betas": [2, 5]}}, world_size=1)
@example(data={"data": {"source": "synthetic", "synthetic_shape": [0]}}, world_size=1)
@example(data={"data": {"source": "synthetic", "synthetic_samples": 10**11}}, world_size=1)
@example(data={"data": {"source": "synthetic", "synthetic_shape": [5]}}, world_size=1)
def test_schema_valid_configs_are_accepted_or_refused_in_one_line(
    data: dict[str, Any], world_size: int, tmp_path_factory: Any
) -> None:
    assume(cheap(data))
    load_and_validate(data, world_size, tmp_path_factory.mktemp("c"))


@st.composite
def broken(draw: st.DrawFn) -> dict[str, Any]:
    data: dict[str, Any] = draw(from_schema(SCHEMA))
    section = draw(st.sampled_from(SECTIONS))
    how = draw(st.sampled_from(["value", "unknown key", "section is a value"]))
    if how == "section is a value":
        data[section] = draw(st.sampled_from(HOSTILE))
        return data
    props = SCHEMA["$defs"].get(
        SCHEMA["properties"][section].get("$ref", "").split("/")[-1], {}
    ).get("properties", {})
    target = data.setdefault(section, {})
    if not isinstance(target, dict) or not props:
        data[section] = draw(st.sampled_from(HOSTILE))
        return data
    if how == "unknown key":
        target[draw(st.sampled_from(["wings", "lr ", "Max_Steps", "", "é"]))] = 1
    else:
        target[draw(st.sampled_from(sorted(props)))] = draw(st.sampled_from(HOSTILE))
    return data


@settings(max_examples=examples(80))
@given(data=broken(), world_size=st.sampled_from([1, 2]))
@example(data={"optim": {"lr": math.inf}}, world_size=1)
@example(data={"train": {"max_steps": math.nan}}, world_size=1)
def test_broken_configs_are_refused_in_one_line(
    data: dict[str, Any], world_size: int, tmp_path_factory: Any
) -> None:
    assume(cheap(data) if isinstance(data.get("data"), dict) else True)
    load_and_validate(data, world_size, tmp_path_factory.mktemp("c"))


def test_non_finite_numbers_are_refused(tmp_path: Path) -> None:
    for key, value in (("optim", {"lr": math.inf}), ("train", {"checkpoint_every_s": math.nan})):
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump({key: value}))
        try:
            load_config(path)
        except ConfigError as exc:
            assert "not allowed" in exc.message
        else:
            raise AssertionError(f"{key}: {value} was accepted")
