"""hpcml.tune's search space and planner check, without running a trial: overrides that
`hpcml train` reads back to the sampled value, spaces refused with one sentence, grids, and
the planner's verdict on a made-up small device."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from hpcml.config import TuneConfig, load_config, parse_override
from hpcml.errors import ConfigError
from hpcml.tune import feasible, space

BASE = {"model": {"name": "mlp", "args": {"hidden": 16}}, "data": {"source": "synthetic"}}


@pytest.mark.parametrize(
    "value", [1e-05, 3.0e-7, 0.1, 2.5e20, 16, 0, True, False, "sgd", "1e-3", "yes", "null"]
)
def test_override_reads_back_as_the_sampled_value(value: object) -> None:
    # YAML reads 1e-05 (no dot) as a string and "yes" as a boolean: the text must say what
    # the value is.
    key, parsed = parse_override(space.override("optim.lr", value))
    assert key == ["optim", "lr"]
    assert parsed == value and type(parsed) is type(value)


def _tune(**space_: dict[str, object]) -> TuneConfig:
    return TuneConfig.model_validate({"space": space_})


@pytest.mark.parametrize(
    ("key", "param", "words"),
    [
        ("optim.lrr", {"type": "float", "low": 0.1, "high": 1}, "optim.lrr"),
        ("optim.lr", {"type": "float", "low": 0.1, "high": 0.1}, "empty range"),
        ("optim.lr", {"type": "float", "low": 0.0, "high": 1, "log": True}, "log scale"),
        ("optim.lr", {"type": "float", "low": -1, "high": 1}, "optim.lr"),  # lr must be > 0
        ("data.batch_size", {"type": "int", "low": 1.5, "high": 8}, "not whole"),
        ("data.batch_size", {"type": "int", "low": 1, "high": 8, "step": 2}, "multiple of step"),
        ("data.batch_size", {"type": "categorical", "choices": []}, "no choices"),
        ("data.batch_size", {"type": "categorical", "choices": [8, 8]}, "twice"),
        ("optim.name", {"type": "categorical", "choices": ["adamw", "lion"]}, "lion"),
        ("optim", {"type": "categorical", "choices": [1]}, "optim"),
        ("tune.seed", {"type": "int", "low": 0, "high": 3}, "inside tune"),
        ("optim.lr", {"type": "float", "low": 1e-3, "high": 1, "choices": [1]}, "categorical"),
    ],
)
def test_a_bad_space_is_refused_in_one_sentence(key: str, param: dict, words: str) -> None:
    with pytest.raises(ConfigError) as exc:
        space.distributions(_tune(**{key: param}), BASE)
    message = exc.value.message
    assert words in message and key in message and "\n" not in message, message


def test_distributions_and_grid_follow_the_space() -> None:
    tune = _tune(
        **{
            "optim.lr": {"type": "float", "low": 1e-4, "high": 1e-1, "log": True},
            "optim.warmup_steps": {"type": "int", "low": 0, "high": 20, "step": 5},
            "optim.weight_decay": {"type": "float", "low": 0.0, "high": 0.3, "step": 0.1},
            "data.batch_size": {"type": "categorical", "choices": [16, 32]},
        }
    )
    d = space.distributions(tune, BASE)
    assert d["optim.lr"] == FloatDistribution(1e-4, 1e-1, log=True)
    assert d["optim.warmup_steps"] == IntDistribution(0, 20, step=5)
    assert d["data.batch_size"] == CategoricalDistribution([16, 32])
    with pytest.raises(ConfigError, match="optim.lr.*continuous or log range"):
        space.grid(d)
    del d["optim.lr"]
    g = space.grid(d)
    assert g["optim.warmup_steps"] == [0, 5, 10, 15, 20]
    assert g["optim.weight_decay"] == [0.0, 0.1, 0.2, 0.3]  # exactly: 0.1 * 3 is not 0.3
    assert g["data.batch_size"] == [16, 32]


def test_an_empty_space_is_refused() -> None:
    with pytest.raises(ConfigError, match="tune.space is empty"):
        space.distributions(TuneConfig(), BASE)


TINY_CATALOG = """\
accelerators:
  tiny-2gb:
    display: a made-up 2 GB device
    memory_bytes: 2.0e9
    memory_bandwidth_bytes_per_s: 1.0e11
    peak_flops: {fp32: 1.0e12}
"""


def test_the_planner_marks_only_a_batch_too_large_for_the_device(tmp_path: Path) -> None:
    catalog = tmp_path / "tiny.yaml"
    catalog.write_text(TINY_CATALOG)
    tune = TuneConfig(device="tiny-2gb", catalog=[str(catalog)])
    feasible.check_device(tune)
    cfg = load_config(None, ["model.name=mlp", "model.args={hidden: 16}"])
    fits = {}
    for batch in (16, 1_000_000):
        cfg.data.batch_size = batch
        fit = feasible.memory_fit(cfg, 1, tune)
        assert fit is not None
        fits[batch] = fit
    assert fits[16].fits and fits[16].violation < 0
    assert not fits[1_000_000].fits and fits[1_000_000].violation > 0
    # 0.9 x 2 GB less the 1 GB CUDA reserve the planner keeps off every device
    assert fits[16].usable_bytes == pytest.approx(0.8e9)
    assert "tiny-2gb" in fits[1_000_000].reason()
    assert feasible.memory_fit(cfg, 1, TuneConfig()) is None  # no device: not checked


def test_an_unknown_device_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tune.device 'tpu-v9'"):
        feasible.check_device(TuneConfig(device="tpu-v9"))


@pytest.mark.parametrize(
    ("name", "cls"),
    [("tpe", "TPESampler"), ("random", "RandomSampler"), ("grid", "GridSampler"),
     ("cmaes", "CmaEsSampler"), ("qmc", "QMCSampler")],
)  # fmt: skip
def test_each_sampler_is_optunas_and_proposes_within_the_space(name: str, cls: str) -> None:
    import optuna

    from hpcml.tune.study import make_sampler

    tune = _tune(
        **{
            "optim.warmup_steps": {"type": "int", "low": 0, "high": 20, "step": 5},
            "optim.weight_decay": {"type": "float", "low": 0.0, "high": 0.3, "step": 0.1},
        }
    )
    tune.sampler = name  # type: ignore[assignment]
    dists = space.distributions(tune, BASE)
    sampler = make_sampler(tune, dists, worker=1, known=2)
    assert type(sampler).__name__ == cls
    if name == "tpe":  # parallel workers: a running trial counts as a bad one (constant liar)
        assert sampler._constant_liar
    if name in ("tpe", "cmaes"):  # Optuna's own number of random trials first, or tune's
        assert sampler._n_startup_trials == (10 if name == "tpe" else 1)
        tune.startup_trials = 3
        assert make_sampler(tune, dists, worker=1)._n_startup_trials == 3
        tune.startup_trials = None
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.create_study(sampler=sampler)
    for i in range(4):
        trial = study.ask(dists)
        assert trial.params["optim.warmup_steps"] in (0, 5, 10, 15, 20)
        assert 0.0 <= trial.params["optim.weight_decay"] <= 0.3
        study.tell(trial, float(i))


def test_pruners_first_rung_is_the_first_evaluation_after_the_longest_warmup() -> None:
    import optuna

    from hpcml.tune.storage import WithoutRetriedAttempts
    from hpcml.tune.study import make_pruner as made

    def make_pruner(*args: Any) -> Any:
        """asha's successive halving, behind the wrapper that hides retried attempts."""
        pruner = made(*args)
        if isinstance(pruner, WithoutRetriedAttempts):
            assert isinstance(pruner.inner, optuna.pruners.SuccessiveHalvingPruner)
            return pruner.inner
        return pruner

    cfg = load_config(None, ["train.eval_every=25", "train.max_steps=400"])
    tune = TuneConfig(pruner="asha")
    assert isinstance(made(tune, cfg), WithoutRetriedAttempts)
    asha = make_pruner(tune, cfg)  # no warmup: the first evaluation
    assert (asha._min_resource, asha._reduction_factor) == (25, 3)
    # A warmup of up to 50 steps in the space: judged first at 75, after every trial's warmup
    # (at 50 the longest has just reached its learning rate).
    warm = {"optim.warmup_steps": IntDistribution(0, 50, step=10)}
    assert make_pruner(tune, cfg, warm)._min_resource == 75
    assert make_pruner(tune, cfg, {"optim.warmup_steps": CategoricalDistribution([0, 30])}) \
        ._min_resource == 50  # fmt: skip
    warm_cfg = load_config(None, ["train.eval_every=25", "train.max_steps=400",
                                  "optim.warmup_steps=60"])  # fmt: skip
    assert make_pruner(tune, warm_cfg)._min_resource == 75  # the config's own warmup
    # A warmup as long as the run leaves nothing to prune before the end.
    assert make_pruner(tune, cfg, {"optim.warmup_steps": IntDistribution(0, 400)}) \
        ._min_resource == 400  # fmt: skip
    tune.first_rung = 10  # set: as given, warmup or not
    assert make_pruner(tune, warm_cfg)._min_resource == 10
    tune.first_rung = None
    tune.pruner = "hyperband"
    longest = {**warm, "train.max_steps": CategoricalDistribution([200, 800])}
    band = make_pruner(tune, cfg, longest)
    assert isinstance(band, optuna.pruners.HyperbandPruner)
    assert (band._min_resource, band._max_resource) == (75, 800)
    tune.pruner = "median"
    median = make_pruner(tune, cfg, warm)
    assert isinstance(median, optuna.pruners.MedianPruner) and median._n_warmup_steps == 75
    tune.pruner = "none"
    assert isinstance(make_pruner(tune, cfg), optuna.pruners.NopPruner)


def test_a_first_rung_past_the_end_or_a_budget_below_one_trial_is_refused() -> None:
    from hpcml.tune import budget

    cfg = load_config(None, ["train.max_steps=60"])
    budget.check(TuneConfig(first_rung=60, step_budget=60), cfg, {})  # the edges are fine
    for tune, words in (
        (TuneConfig(first_rung=61), "tune.first_rung 61 is past the trials' last step (60)"),
        (TuneConfig(step_budget=59), "tune.step_budget 59 is smaller than one trial (60"),
    ):
        with pytest.raises(ConfigError) as exc:
            budget.check(tune, cfg, {})
        assert exc.value.message.startswith(words) and "\n" not in exc.value.message
    # The longest trial is the space's largest train.max_steps.
    with pytest.raises(ConfigError, match="smaller than one trial \\(90 steps\\)"):
        budget.check(TuneConfig(step_budget=80), cfg, {"train.max_steps": IntDistribution(30, 90)})


def _study_with(trials: int, pruned: bool) -> object:
    import optuna
    from optuna.trial import TrialState, create_trial

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    dist = {"optim.lr": FloatDistribution(1e-4, 1e-1, log=True)}
    study = optuna.create_study(study_name="s", direction="minimize")
    for i in range(trials):
        curve = {5: 2.0 - 0.1 * i, 10: 1.9 - 0.1 * i}
        study.add_trial(
            create_trial(value=curve[10], params={"optim.lr": 10.0 ** (-1 - i)},
                         distributions=dist, intermediate_values=curve)
        )  # fmt: skip
    if pruned:
        study.add_trial(
            create_trial(state=TrialState.PRUNED, params={"optim.lr": 0.05}, distributions=dist,
                         intermediate_values={5: 2.5})
        )  # fmt: skip
    return study


@pytest.mark.parametrize(("trials", "pruned"), [(3, True), (1, False)])
def test_the_report_page_shows_each_plot(tmp_path: Path, trials: int, pruned: bool) -> None:
    import matplotlib.image

    from hpcml.tune.report import PLOTS, summary, write_report

    study = _study_with(trials, pruned)
    result = summary(study, "memory")  # type: ignore[arg-type]
    page = write_report(study, tmp_path / "report", result)  # type: ignore[arg-type]
    text = page.read_text()
    assert f"&quot;pruned&quot;: {int(pruned)}" in text  # the summary is on the page (escaped)
    for name in PLOTS:
        assert f'<img src="{name}.png"' in text
        pixels = matplotlib.image.imread(tmp_path / "report" / f"{name}.png")
        assert pixels.shape[0] > 100 and pixels.shape[1] > 100


def _job(trials: int, timeout_s: float | None = None, started: float | None = None) -> object:
    import time

    from hpcml.tune.study import TuneJob

    return TuneJob(
        config=Path("c.yaml"), overrides=(), out=Path("out"), storage="memory", study="s",
        trials=trials, timeout_s=timeout_s, started=started or time.time(),
    )  # fmt: skip


def test_a_retried_trial_counts_once_and_the_budget_stops_new_trials() -> None:
    import time

    import optuna
    from optuna.storages import RetryHeartbeatStaleTrialCallback
    from optuna.trial import TrialState, create_trial

    from hpcml.tune.report import counts
    from hpcml.tune.study import next_action

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    dist = {"optim.lr": FloatDistribution(1e-4, 1e-1, log=True)}
    study = optuna.create_study(study_name="s")
    study.add_trial(create_trial(value=1.0, params={"optim.lr": 0.01}, distributions=dist))
    killed = create_trial(state=TrialState.FAIL, params={"optim.lr": 0.02}, distributions=dist)
    study.add_trial(killed)
    # What a dead worker's trial gets: failed, and queued again with its parameters.
    RetryHeartbeatStaleTrialCallback(2)(study, study.get_trials()[1])
    n = counts(study.get_trials())
    assert (n["complete"], n["failed"]) == (1, 0)  # the retry will count, not the failure
    assert next_action(study, _job(2), study.sampler) == "run"
    retry = study.ask()
    assert retry.params == {"optim.lr": 0.02}
    assert next_action(study, _job(2), study.sampler) == "wait"  # the retry is running
    study.tell(retry, 0.5)
    assert next_action(study, _job(2), study.sampler) == "done"
    # tune.timeout_s: no new trial once it has passed since the tune started.
    late = _job(5, timeout_s=1.0, started=time.time() - 10.0)
    assert next_action(study, late, study.sampler) == "done"
    assert next_action(study, _job(5, timeout_s=3600.0), study.sampler) == "run"


def test_the_step_budget_starts_a_trial_only_while_a_full_one_fits() -> None:
    """tune.step_budget: finished trials count the steps their runs took (a pruned one its
    fewer; a failed one whose worker died up to its last evaluation), running ones a full
    trial; with too little left the worker waits for running trials (one pruned early gives
    steps back), or is done."""
    import optuna
    from optuna.trial import TrialState, create_trial

    from hpcml.tune.study import next_action

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    dist = {"optim.lr": FloatDistribution(1e-4, 1e-1, log=True)}
    study = optuna.create_study(study_name="s")

    def add(state: TrialState, steps: int | None, last: int = 10) -> None:
        study.add_trial(
            create_trial(state=state, value=1.0 if state == TrialState.COMPLETE else None,
                         params={"optim.lr": 0.01}, distributions=dist,
                         intermediate_values={last: 1.0},
                         user_attrs={} if steps is None else {"steps": steps})
        )  # fmt: skip

    def action(budget: int) -> str:
        job = dataclasses.replace(_job(100), step_budget=budget, trial_steps=60)
        return next_action(study, job, study.sampler)

    add(TrialState.COMPLETE, 60)
    add(TrialState.PRUNED, 21)  # pruned at its step-20 rung, stopped at the next step
    add(TrialState.FAIL, None, last=20)  # its worker died after the evaluation at step 20
    assert action(161) == "run"  # 60 + 21 + 20 = 101 taken: 60 left, a full trial fits
    assert action(160) == "done"
    running = study.ask()  # counts as a full trial while it runs
    assert action(221) == "run" and action(220) == "wait"
    study.tell(running, state=TrialState.PRUNED)  # pruned before any step record: 0 steps
    assert action(220) == "run"


def test_the_sample_budget_charges_each_step_its_global_batch() -> None:
    """tune.sample_budget: a trial takes its steps times its global batch (data.batch_size x
    grad_accum x data-parallel processes, or train.global_batch); finished trials count what
    their runs took (a failed one up to its last evaluation, at the batch it recorded when it
    started), running ones the largest trial the space allows (its longest run at its largest
    batch); a budget below that largest trial is refused."""
    import optuna
    from optuna.trial import TrialState, create_trial

    from hpcml.tune import budget
    from hpcml.tune.study import next_action

    def cfg(*overrides: str) -> object:
        return load_config(None, ["train.max_steps=60", "data.batch_size=16", *overrides])

    assert budget.samples_per_step(cfg("train.grad_accum=2"), nproc=2) == 64  # 16 x 2 x 2
    assert budget.samples_per_step(cfg("parallel.tp=2", "model.name=gpt-tiny"), nproc=2) == 16
    assert budget.samples_per_step(cfg("train.global_batch=48"), nproc=1) == 48
    batches = {"data.batch_size": CategoricalDistribution([16, 32, 64])}
    assert budget.trial_samples(cfg(), batches, nproc=1) == 60 * 64
    assert budget.trial_samples(cfg(), {**batches, "train.max_steps": IntDistribution(30, 90)},
                                nproc=2) == 90 * 64 * 2  # fmt: skip
    either = {"train.global_batch": CategoricalDistribution([None, 128])}  # null: derived
    assert budget.trial_samples(cfg(), {**batches, **either}, nproc=1) == 60 * 128
    budget.check_samples(TuneConfig(sample_budget=3840), 3840)  # the edge is fine
    with pytest.raises(ConfigError) as exc:
        budget.check_samples(TuneConfig(sample_budget=3839), 3840)
    assert exc.value.message.startswith(
        "tune.sample_budget 3839 is smaller than the largest trial (3840 samples"
    )

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    dist = {"data.batch_size": CategoricalDistribution([16, 32, 64])}
    study = optuna.create_study(study_name="s")

    def add(state: TrialState, attrs: dict[str, int], last: int | None = 20) -> None:
        study.add_trial(
            create_trial(state=state, value=1.0 if state == TrialState.COMPLETE else None,
                         params={"data.batch_size": 64}, distributions=dist,
                         intermediate_values={} if last is None else {last: 1.0},
                         user_attrs=attrs)
        )  # fmt: skip

    add(TrialState.COMPLETE, {"steps": 60, "samples": 60 * 64, "samples_per_step": 64})
    add(TrialState.PRUNED, {"steps": 21, "samples": 21 * 16, "samples_per_step": 16})
    add(TrialState.FAIL, {"samples_per_step": 32})  # its worker died after step 20's evaluation
    add(TrialState.PRUNED, {"infeasible": 1}, last=None)  # never started: takes nothing
    taken = 60 * 64 + 21 * 16 + 20 * 32  # 4816: not 101 steps, and not 101 x a batch

    def action(samples: int, steps: int | None = None) -> str:
        job = dataclasses.replace(_job(100), sample_budget=samples, trial_samples=3840,
                                  step_budget=steps, trial_steps=60)  # fmt: skip
        return next_action(study, job, study.sampler)

    assert action(taken + 3840) == "run" and action(taken + 3839) == "done"
    assert action(taken + 3840, steps=160) == "done"  # both budgets hold: the steps ran out
    running = study.ask()  # counts as the largest trial while it runs
    assert action(taken + 2 * 3840) == "run" and action(taken + 2 * 3840 - 1) == "wait"
    study.tell(running, state=TrialState.PRUNED)  # pruned before any step record
    assert action(taken + 3840) == "run"


def test_worker_seeds_wrap_at_numpys_limit() -> None:
    """tune.seed takes NumPy's range, and a worker's offset wraps past its end (a worker whose
    seed was 2^32 died in its sampler's first draw)."""
    import optuna
    from pydantic import ValidationError

    from hpcml.tune.study import make_sampler

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    dists = {"optim.lr": FloatDistribution(1e-4, 1e-1, log=True)}
    for name in ("tpe", "random"):
        tune = TuneConfig(sampler=name, seed=2**32 - 1)  # type: ignore[arg-type]
        study = optuna.create_study(sampler=make_sampler(tune, dists, worker=1, known=3))
        assert 1e-4 <= study.ask(dists).params["optim.lr"] <= 1e-1
    for bad in (-1, 2**32):
        with pytest.raises(ValidationError):
            TuneConfig(seed=bad)


def test_a_journal_trial_whose_heartbeat_stopped_is_failed_and_queued_again(tmp_path: Path) -> None:
    """The journal storage has no heartbeat of Optuna's: a trial run on another host whose
    `heartbeat` attribute is older than GRACE_S is failed and queued again; one that beat
    recently, or whose worker lives on this host, is left running."""
    import os
    import time

    import optuna
    from optuna.trial import TrialState

    from hpcml.tune import storage as st
    from hpcml.tune.trial import worker_identity

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    url = st.default_storage(tmp_path)
    study = optuna.create_study(study_name="s", storage=st.open_storage(url))
    elsewhere = {"host": os.uname().nodename + "-other", "pid": 1, "started": "0"}
    now = time.time()
    beats = {"stale": now - st.GRACE_S - 5, "fresh": now - 5, "here": now - st.GRACE_S - 5}
    for name, beat in beats.items():
        t = study.ask({"optim.lr": FloatDistribution(1e-4, 1e-1, log=True)})
        t.set_user_attr("name", name)
        t.set_user_attr("worker", worker_identity() if name == "here" else elsewhere)
        t.set_user_attr("heartbeat", beat)
    # Another process opens the same file, as a worker on another node would.
    other = optuna.load_study(study_name="s", storage=st.open_storage(url))
    st.fail_dead_trials(other)
    trials = optuna.load_study(study_name="s", storage=st.open_storage(url)).get_trials()
    state = {t.user_attrs["name"]: t.state for t in trials[:3]}
    assert state == {"stale": TrialState.FAIL, "fresh": TrialState.RUNNING,
                     "here": TrialState.RUNNING}  # fmt: skip
    assert len(trials) == 4 and trials[3].state == TrialState.WAITING  # the stale one's retry
    assert trials[3].params == trials[0].params


def test_storage_urls_open_the_storage_they_name(tmp_path: Path) -> None:
    from optuna.storages.journal import JournalStorage

    from hpcml.tune import storage as st

    assert st.default_storage(tmp_path) == f"journal:{tmp_path.resolve()}/study.journal"
    assert isinstance(st.open_storage(st.default_storage(tmp_path)), JournalStorage)
    with pytest.raises(ConfigError, match="is a folder"):
        st.open_storage(f"journal:{tmp_path}")


def test_the_metrics_tune_accepts_are_scores_an_evaluation_reports() -> None:
    """tune.metric is checked before any trial against hpcml.tune.study.SCORES: each must be
    in what hpcml.train's evaluation reports, for the validation split and each eval set."""
    import contextlib
    import types

    import torch

    from hpcml.distributed.runtime import Runtime
    from hpcml.train import eval_sets
    from hpcml.train.evaluation import evaluate_model
    from hpcml.tune.study import SCORES, check_metric

    rt = Runtime(0, 0, 1, 1, torch.device("cpu"), None)
    batch = (torch.zeros(4, 3), torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.bool))
    precision = types.SimpleNamespace(autocast=contextlib.nullcontext)
    scores = evaluate_model(torch.nn.Linear(3, 2), [batch], rt, precision, False)
    assert set(SCORES) <= set(scores) and set(eval_sets.METRICS) == set(SCORES)
    cfg = load_config(None, ["tune={metric: old/val_accuracy}", "train.eval_sets={old: d}"])
    check_metric(cfg)  # an eval set's score
    cfg.train.eval_sets = None
    with pytest.raises(ConfigError, match="'old/val_accuracy' is not among"):
        check_metric(cfg)
