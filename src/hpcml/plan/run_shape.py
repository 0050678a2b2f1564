"""The planner's own shape of a measured run's model, from its summary.json: a model the planner
knows is predicted from its own numbers; one it does not (or a zoo CNN off its 3x32x32 table
entry) takes its parameter count and FLOPs from the run, and its notes say so."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hpcml.plan.common import PlanError, get_path
from hpcml.plan.shapes import (
    CNN_TABLE_INPUT,
    ModelShape,
    cnn_table_covers,
    is_table_cnn,
    model_shape,
    transformer,
)

_DIM_KEYS = {
    "layers": ("n_layer", "n_layers", "num_layers", "layers", "depth"),
    "hidden": ("n_embd", "d_model", "hidden_size", "hidden", "dim"),
    "heads": ("n_head", "n_heads", "num_heads", "heads"),
    "seq": ("block_size", "seq_len", "max_seq_len", "context_length", "seq"),
    "vocab": ("vocab_size", "vocab"),
}


def shape_from_run(
    summary: Mapping[str, Any], config: Mapping[str, Any]
) -> tuple[ModelShape, list[str]]:
    """The planner's own shape of the run's model. Only a model the planner does not know
    takes its numbers from the run, and the notes say so: a prediction that copies the
    measurement would agree with it by construction."""
    name = str(
        get_path(
            config, "model", "name", default=get_path(summary, "model", "name", default="model")
        )
    )
    args = dict(
        get_path(summary, "model", "args", default=None)
        or get_path(config, "model", "args", default=None)
        or {}
    )
    params = get_path(summary, "model", "parameters")
    fwd = get_path(summary, "model", "forward_flops_per_sample")
    notes: list[str] = []
    input_shape = _run_input_shape(summary, config)
    try:
        shape = model_shape(name, args)
    except PlanError:
        try:
            # The engine fills in default arguments (num_classes, in_channels): the table
            # entry of the default model describes it, at the table's input size only.
            if not cnn_table_covers(name, args, input_shape):
                raise
            shape = model_shape(name)
        except PlanError:
            if is_table_cnn(name) and params:
                return _cnn_from_run(name, summary, input_shape, int(params), fwd)
            dims = {
                k: next((int(args[a]) for a in keys if a in args), 0)
                for k, keys in _DIM_KEYS.items()
            }
            if not params:
                raise PlanError(
                    f"the run's summary.json gives no parameter count for model '{name}' and "
                    "the planner does not know it; the summary needs model.parameters."
                ) from None
            if dims["layers"] and dims["hidden"] and dims["heads"]:
                shape = transformer(
                    name,
                    dims["layers"],
                    dims["hidden"],
                    dims["heads"],
                    dims["seq"] or 256,
                    dims["vocab"] or 256,
                    params=int(params),
                    source="run summary",
                )
            else:
                shape = ModelShape(
                    name,
                    int(params),
                    forward_flops_per_sample=float(fwd or 2.0 * params),
                    source="run summary",
                )
            notes.append(
                f"'{name}' is not known to the planner: its parameter count (and FLOPs) come "
                "from the run, so those rows are not independent predictions"
            )
    if params and int(params) != shape.params:
        notes.append(f"the planner counts {shape.params:,} parameters, the run {int(params):,}")
    return shape, notes


def _run_input_shape(summary: Mapping[str, Any], config: Mapping[str, Any]) -> Any:
    """One sample's input shape: recorded by hpcml train, or for older summaries of synthetic
    data, the configured shape; None when neither says."""
    recorded = get_path(summary, "model", "input_shape")
    if recorded:
        return recorded
    if get_path(config, "data", "source") == "synthetic":
        return get_path(config, "data", "synthetic_shape")
    return None


def _cnn_from_run(
    name: str, summary: Mapping[str, Any], input_shape: Any, params: int, fwd: Any
) -> tuple[ModelShape, list[str]]:
    """A zoo CNN the table does not cover (another input size or class count): its parameter
    count and FLOPs are the run's own (counted by torch at set-up), its activations come from
    the run's traced step when the summary holds one, else they are not predicted."""
    traced = get_path(summary, "memory_trace", "activations_bytes_per_sample")
    where = "x".join(str(d) for d in input_shape) if input_shape else "its input size"
    notes = [
        f"the planner's table holds {name} at {'x'.join(map(str, CNN_TABLE_INPUT))} with "
        f"default arguments only; at {where} its parameters and FLOPs come from the run's own "
        "count (not independent predictions)"
    ]
    if traced is None:
        notes.append("its activations are not predicted: trace them with plan memory --trace")
    else:
        notes.append("its activations come from the run's traced step (hpcml plan memory --trace)")
    shape = ModelShape(
        name,
        params,
        forward_flops_per_sample=float(fwd or 2.0 * params),
        activation_bytes_per_sample=float(traced) if traced is not None else None,
        activations_traced=traced is not None,
        source=f"run summary, {where}",
    )
    return shape, notes
