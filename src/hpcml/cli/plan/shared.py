"""The options the `hpcml plan` verbs share, defined once: a model, a cluster, a layout, a
training setup, a calibration, the catalog and --json.

A verb takes the groups it needs with `@plan_options(MODEL, LAYOUT, ...)` and receives their
values as one `PlanOptions` (its first parameter, `opts`), which builds the planner's objects
(`opts.shape()`, `opts.cluster(...)`, `opts.layout()`, `opts.training()`,
`opts.calibration(...)`). Its own options stay ordinary typer parameters after `opts`.

Typer has no option groups of its own (fastapi/typer issues #153 and #264 are open requests):
it reads a command's parameters from its signature, so `plan_options` writes the shared options
into the signature of a wrapper that gathers them. Every parameter is keyword-only and typer
passes them by name, so a verb's own positional arguments still parse (the failure of such
decorators reported in typer #1898; tests/unit/test_plan_cli_options.py checks it).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, get_type_hints

from hpcml.cli.plan import options as o
from hpcml.plan.common import PlanError


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """Values of the shared options; a verb that does not offer one gets its default here
    (checked against the option's own default when a verb is declared)."""

    model: str | None = None
    args: str = "{}"
    params: float | None = None
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    seq: int | None = None
    vocab: int | None = None
    ffn: int | None = None
    flops: float | None = None
    kv_heads: int | None = None
    swiglu: bool = False
    largest_layer: float | None = None
    devices: int = 1
    gpu: str | None = None
    node: str | None = None
    per_node: int | None = None
    intra: str | None = None
    inter: str | None = None
    nics: int | None = None
    tp: int = 1
    pp: int = 1
    zero: int = 0
    sp: bool | None = None
    schedule: str = "1f1b"
    virtual: int = 2
    mb: int = 1
    accum: int = 1
    accum_reduce: str = "step"
    recompute: str = "none"
    offload: str = "none"
    attention: str | None = None
    optimizer: str = "adamw"
    precision: str = "bf16"
    weights: str | None = None
    grad_dtype: str | None = None
    efficiency: float | None = None
    overhead: float = 0.0
    overlap: float = 1.0
    calibration_file: Path | None = None
    catalog: list[Path] | None = None
    json_out: bool = False

    def load_catalog(self) -> Any:
        from hpcml.plan.hardware import load_catalog

        return load_catalog(self.catalog or [])

    def shape(self) -> Any:
        """The planner's ModelShape: a known model (--model, --args) or raw numbers. An option
        the chosen path would ignore is refused, never dropped silently."""
        from hpcml.plan.shapes import model_shape, shape_from_raw

        self._refuse_ignored()
        if self.model:
            try:
                parsed = json.loads(self.args)
            except json.JSONDecodeError:
                raise PlanError(
                    f"--args {self.args!r} is not valid JSON; pass an object like "
                    "'{\"hidden\": 512}'."
                ) from None
            shape = model_shape(self.model, parsed, seq=self.seq)
            if self.seq and not shape.is_transformer:
                raise PlanError(
                    f"--seq is ignored by --model {self.model}, which is not a transformer; "
                    "drop --seq (its input shape comes with the model)."
                )
            return shape
        return shape_from_raw(
            params=int(self.params) if self.params else None,
            layers=self.layers,
            hidden=self.hidden,
            heads=self.heads,
            seq=self.seq,
            vocab=self.vocab,
            ffn_hidden=self.ffn,
            kv_heads=self.kv_heads,
            flops_per_sample=self.flops,
            swiglu=self.swiglu,
            largest_layer=self.largest_layer,
        )

    def _refuse_ignored(self) -> None:
        """One sentence for options the model path in use does not read."""
        given = {
            "--params": self.params,
            "--layers": self.layers,
            "--hidden": self.hidden,
            "--heads": self.heads,
            "--vocab": self.vocab,
            "--ffn-hidden": self.ffn,
            "--flops-per-sample": self.flops,
            "--kv-heads": self.kv_heads,
            "--swiglu": self.swiglu,
            "--largest-layer": self.largest_layer,
        }
        if self.model:
            ignored = [n for n, v in given.items() if v]
            when = f"--model {self.model} is given (a known model carries its own shape)"
            fix = "drop them, or describe the model by numbers without --model"
        elif self.layers and self.hidden:
            ignored = ["--flops-per-sample"] if self.flops else []
            ignored += ["--args"] if self.args != "{}" else []
            when = "the model is a transformer given by --layers and --hidden (counted from them)"
            fix = "drop them"
        else:
            transformer_only = ("--heads", "--vocab", "--ffn-hidden", "--kv-heads", "--swiglu")
            ignored = [n for n in transformer_only if given[n]]
            ignored += ["--seq"] if self.seq else []
            ignored += ["--args"] if self.args != "{}" else []
            when = "the model is given by --params alone"
            fix = "add --layers and --hidden to describe its transformer blocks, or drop them"
        if ignored:
            verb = "is" if len(ignored) == 1 else "are"
            raise PlanError(f"{', '.join(ignored)} {verb} not used when {when}; {fix}.")

    def cluster(self, catalog: Any, devices: int | None = None) -> Any:
        from hpcml.plan.hardware import resolve_cluster

        return resolve_cluster(
            catalog,
            self.devices if devices is None else devices,
            accelerator=self.gpu,
            node=self.node,
            devices_per_node=self.per_node,
            intra=self.intra,
            inter=self.inter,
            nics_per_node=self.nics,
        )

    def layout(self) -> Any:
        from hpcml.plan.memory import Layout

        return Layout(
            tp=self.tp,
            pp=self.pp,
            zero=self.zero,
            sp=(self.tp > 1) if self.sp is None else self.sp,
            schedule=self.schedule,
            virtual_stages=self.virtual if self.schedule == "interleaved" else 1,
            micro_batch=self.mb,
            grad_accum=self.accum,
            accum_reduce=self.accum_reduce,
            recompute=self.recompute,
            offload=self.offload,
            attention=self.attention,
        )

    def training(self) -> Any:
        from hpcml.plan.memory import Training

        return Training(
            precision=self.precision,
            optimizer=self.optimizer,
            weights=self.weights,
            grad_dtype=self.grad_dtype,
        )

    def calibration(self, cluster: Any) -> Any:
        from hpcml.plan.perf import Calibration

        if self.calibration_file is not None:
            if self.efficiency is not None or self.overhead:
                raise PlanError(
                    "--calibration holds a fitted efficiency and software costs; drop "
                    "--efficiency and --overhead-s."
                )
            return load_calibration(self.calibration_file, cluster.accelerator.key)
        if self.efficiency is None:
            return Calibration(cluster.accelerator.default_efficiency, self.overhead)
        if not 0 < self.efficiency <= 1.5:
            raise PlanError(f"--efficiency {self.efficiency} must lie in (0, 1.5].")
        return Calibration(self.efficiency, self.overhead, "--efficiency")


def load_calibration(path: Path, accelerator: str) -> Any:
    """A calibration `plan check --save-calibration` wrote, for `accelerator`'s runs."""
    import math

    from hpcml.plan.perf import Calibration

    what = f"--calibration {path}"
    hint = "give the JSON file `hpcml plan check --save-calibration` wrote"
    try:
        data = json.loads(path.read_text())
        cal = Calibration.from_dict(data["calibration"])
        fitted_on = str(data["accelerator"])
    except OSError:
        raise PlanError(f"{what} cannot be read; {hint}.") from None
    except (ValueError, KeyError, TypeError, AttributeError):
        raise PlanError(f"{what} is not a calibration; {hint}.") from None
    costs = [
        cal.overhead_s,
        cal.collective_overhead_s,
        cal.tensor_overhead_s,
        cal.tp_tensor_overhead_s,
        *(v for _, v in cal.collective_costs_s),
    ]
    numbers = [cal.efficiency, *costs, *cal.error_log, cal.noise_log or 0.0]
    # Costs are never negative; errors (log measured / predicted) are either sign.
    if not all(math.isfinite(v) for v in numbers) or cal.efficiency <= 0 or min(costs) < 0:
        raise PlanError(f"{what} holds a negative or non-finite cost; {hint}.")
    if fitted_on != accelerator:
        raise PlanError(
            f"{what} was fitted on {fitted_on} runs, not {accelerator}; fit one on runs of "
            "this hardware."
        )
    return cal


# Each shared option: its PlanOptions field and its typer option (flags, default, help).
OPTIONS: dict[str, Any] = {
    "model": o.MODEL_OPT,
    "args": o.ARGS_OPT,
    "params": o.PARAMS_OPT,
    "layers": o.LAYERS_OPT,
    "hidden": o.HIDDEN_OPT,
    "heads": o.HEADS_OPT,
    "seq": o.SEQ_OPT,
    "vocab": o.VOCAB_OPT,
    "ffn": o.FFN_OPT,
    "flops": o.FLOPS_OPT,
    "kv_heads": o.KV_HEADS_OPT,
    "swiglu": o.SWIGLU_OPT,
    "largest_layer": o.LARGEST_LAYER_OPT,
    "devices": o.DEVICES_OPT,
    "gpu": o.GPU_OPT,
    "node": o.NODE_OPT,
    "per_node": o.PER_NODE_OPT,
    "intra": o.INTRA_OPT,
    "inter": o.INTER_OPT,
    "nics": o.NICS_OPT,
    "tp": o.TP_OPT,
    "pp": o.PP_OPT,
    "zero": o.ZERO_OPT,
    "sp": o.SP_OPT,
    "schedule": o.SCHEDULE_OPT,
    "virtual": o.VIRTUAL_OPT,
    "mb": o.MB_OPT,
    "accum": o.ACCUM_OPT,
    "accum_reduce": o.ACCUM_REDUCE_OPT,
    "recompute": o.RECOMPUTE_OPT,
    "offload": o.OFFLOAD_OPT,
    "attention": o.ATTENTION_OPT,
    "optimizer": o.OPTIM_OPT,
    "precision": o.PRECISION_OPT,
    "weights": o.WEIGHTS_OPT,
    "grad_dtype": o.GRAD_DTYPE_OPT,
    "efficiency": o.EFF_OPT,
    "overhead": o.OVERHEAD_OPT,
    "overlap": o.OVERLAP_OPT,
    "calibration_file": o.CALIBRATION_FILE_OPT,
    "catalog": o.CATALOG_OPT,
    "json_out": o.JSON_OPT,
}

MODEL: tuple[str, ...] = (
    "model",
    "args",
    "params",
    "layers",
    "hidden",
    "heads",
    "seq",
    "vocab",
    "ffn",
    "flops",
    "kv_heads",
    "swiglu",
    "largest_layer",
)
CLUSTER = ("devices", "gpu", "node", "per_node", "intra", "inter", "nics")
LAYOUT: tuple[str, ...] = (
    "tp",
    "pp",
    "zero",
    "sp",
    "schedule",
    "virtual",
    "mb",
    "accum",
    "accum_reduce",
    "recompute",
    "offload",
    "attention",
)
TRAINING = ("optimizer", "precision", "weights", "grad_dtype")
CALIBRATION = ("efficiency", "overhead", "overlap", "calibration_file")
OUTPUT = ("catalog", "json_out")

_FIELDS = {f.name: f for f in dataclasses.fields(PlanOptions)}
_TYPES = get_type_hints(PlanOptions)


def _parameter(name: str) -> inspect.Parameter:
    option, field = OPTIONS[name], _FIELDS[name]
    if option.default != field.default:
        # A verb without this option gets PlanOptions' default: it must be the option's.
        raise AssertionError(f"PlanOptions.{name} defaults to {field.default!r}, not {option}")
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=_TYPES[name]
    )


def plan_options(
    *groups: Sequence[str], drop: Sequence[str] = ()
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a verb the shared options of `groups` (less `drop`), gathered into `opts`."""
    names = [n for g in groups for n in g if n not in drop]

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        own = list(inspect.signature(func, eval_str=True).parameters.values())
        if not own or own[0].name != "opts":
            raise TypeError(f"{func.__name__} must take `opts: PlanOptions` first")
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own[1:]]
        clash = sorted(set(names) & {p.name for p in own})
        if clash:
            raise TypeError(f"{func.__name__} declares shared option(s) {clash} itself")
        params = [_parameter(n) for n in names] + own

        @functools.wraps(func)
        def command(**values: Any) -> Any:
            shared = PlanOptions(**{n: values.pop(n) for n in names})
            return func(shared, **values)

        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate
