"""What a resume does with a config that differs from the one its checkpoint was written with.

Every hyperparameter the checkpoint carries is either applied or refused; none is silently
kept from the checkpoint while `config.yaml` records another value:

- applied: the optimizer's hyperparameters (lr, betas, eps, weight decay, momentum,
  `scale_lr_with_world`) are set from the config after the checkpoint's param groups are
  loaded, and the scheduler's base lrs with them; the schedule (kind, warmup, floor, horizon:
  see `checkpoint.check_lr_horizon`), `grad_clip`, the batch (`data.batch_size`,
  `train.grad_accum`, `train.global_batch`) and `precision` are read from the config at every
  step. A changed batch size continues at the next unseen sample (the elastic position).
- refused, in one sentence and exit 2 before anything is written: those that would make the
  run differ from what the config says in a way the checkpoint cannot express (`REFUSED`).
"""

from __future__ import annotations

from typing import Any

import torch

from hpcml.config import RunConfig
from hpcml.errors import ConfigError

APPLIED = (
    "optim.lr",
    "optim.scale_lr_with_world",
    "optim.betas",
    "optim.eps",
    "optim.weight_decay",
    "optim.momentum",
    "optim.grad_clip",
    "optim.schedule",
    "optim.warmup_steps",
    "optim.min_lr_ratio",
    "optim.decay_steps",
    "data.batch_size",
    "train.grad_accum",
    "train.global_batch",
    "precision",
)
"""Changes a resume applies (dotted keys of RunConfig)."""

REFUSED = {
    "train.seed": "the random state and the order of the current epoch come from the checkpoint",
    "data.shuffle": "the order of the current epoch comes from the checkpoint",
    "data.val_fraction": "it moves samples between the training and the validation split",
    "optim.decay_norms_biases_embeddings": "it regroups the optimizer's parameters",
}
"""Changes a resume refuses, with the reason its sentence gives."""


def _get(d: dict[str, Any], dotted: str) -> Any:
    section, _, key = dotted.partition(".")
    value = d.get(section)
    if key:
        value = value.get(key) if isinstance(value, dict) else None
    return list(value) if isinstance(value, tuple) else value


def changed(saved: dict[str, Any] | None, cfg: RunConfig, keys: Any) -> dict[str, list[Any]]:
    """{key: [checkpoint's value, this run's value]} for the `keys` that differ."""
    if not isinstance(saved, dict):  # written before checkpoints stored their config
        return {}
    now = cfg.model_dump(mode="json")
    out = {}
    for key in keys:
        before, after = _get(saved, key), _get(now, key)
        if before != after:
            out[key] = [before, after]
    return out


def _grouped(optim: dict[str, Any]) -> bool:
    """Whether `schedule.param_groups` splits the parameters into decayed and not decayed."""
    return bool(optim.get("weight_decay")) and not optim.get("decay_norms_biases_embeddings")


def refuse_unappliable(path: Any, saved: dict[str, Any] | None, cfg: RunConfig) -> None:
    """Raise a ConfigError naming the first change a resume from `path` cannot apply."""
    for key, (before, after) in changed(saved, cfg, REFUSED).items():
        raise ConfigError(
            f"{key} is {after} here but checkpoint {path} was trained with {before}, and a "
            f"resume cannot apply that ({REFUSED[key]}); resume with {key}={before} or start a "
            "new --run-dir."
        )
    if isinstance(saved, dict) and _grouped(saved.get("optim", {})) != _grouped(
        cfg.optim.model_dump()
    ):
        before = saved.get("optim", {}).get("weight_decay")
        raise ConfigError(
            f"optim.weight_decay is {cfg.optim.weight_decay} here but checkpoint {path} was "
            f"trained with {before}, and going from or to 0 regroups the optimizer's "
            "parameters (norms, biases and embeddings are not decayed), which a resume cannot "
            "apply; resume with a weight decay that is 0 as before (or non-zero as before), "
            "or start a new --run-dir."
        )


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimizer's per-group settings as the config built them (call before loading)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def apply_hyperparameters(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    fresh: list[dict[str, Any]],
) -> None:
    """After loading: the config's settings over the checkpoint's, in every param group, the
    scheduler's base lrs from the config, and each group's lr at the resumed step from them
    (ZeRO-1's wrapper passes its groups on to the local optimizer at each step)."""
    scheduler.base_lrs = [g["initial_lr"] for g in fresh]
    at = scheduler.last_epoch
    for group, settings, fn in zip(
        optimizer.param_groups, fresh, scheduler.lr_lambdas, strict=True
    ):
        group.update({k: v for k, v in settings.items() if k != "lr"})
        group["lr"] = settings["initial_lr"] * fn(at)


def global_batch(cfg: dict[str, Any], world_size: int, tp: int, pp: int = 1) -> int:
    """Samples per optimizer step of a (dumped) config on `world_size` processes."""
    dp = world_size // (tp * pp)
    return int(cfg["data"]["batch_size"]) * int(cfg["train"]["grad_accum"]) * dp


def global_batch_note(
    saved: dict[str, Any] | None, trainer: dict[str, Any], cfg: RunConfig, now: int, dp: int
) -> str | None:
    """One line when the global batch differs from the checkpoint's, or None."""
    if not isinstance(saved, dict) or "world_size" not in trainer:
        return None
    layout = int(trainer["world_size"]), int(trainer.get("tp", 1)), int(trainer.get("pp", 1))
    before = global_batch(saved, *layout)
    if before == now:
        return None
    how = (
        f"set train.global_batch={before} to keep it"
        if cfg.train.global_batch is None
        else "as train.global_batch says"
    )
    return (
        f"the global batch becomes {now} (data.batch_size {cfg.data.batch_size} x "
        f"train.grad_accum {cfg.train.grad_accum} x {dp} data-parallel process(es)); the "
        f"checkpoint was trained with {before} on {trainer['world_size']} process(es); {how}."
    )


def restore_data(
    train_data: Any, loaded: Any, saved: dict[str, Any] | None, cfg: RunConfig
) -> None:
    """The data position of `loaded` (a `checkpoint.Loaded`): this rank's loader state when the
    layout and batch size are the checkpoint's, else the next unseen sample of the global order."""
    same_batch = not changed(saved, cfg, ["data.batch_size"])
    if loaded.rank_state is not None and same_batch:
        train_data.load_state_dict(loaded.rank_state["data"])
    elif "data_position" in loaded.trainer:
        pos = loaded.trainer["data_position"]
        train_data.resume_at(int(pos["epoch"]), int(pos["samples"]), pos.get("layout"))
    else:  # written before positions were stored: continue at the next epoch boundary
        epoch = int(loaded.trainer.get("epoch", 0)) + 1
        train_data.load_state_dict({"epoch": epoch, "loader": None})


def record(loaded: Any, saved: dict[str, Any] | None, cfg: RunConfig) -> dict[str, Any]:
    """The run.jsonl record of a resume: from where, and each applied change [before, after]."""
    return {
        "kind": "resume",
        "step": loaded.step,
        "checkpoint": str(loaded.path),
        "applied": changed(saved, cfg, APPLIED),
    }


def applied_line(rec: dict[str, Any]) -> str:
    changes = ", ".join(f"{k} {old} -> {new}" for k, (old, new) in rec["applied"].items())
    return f"applied on resume: {changes}."
