"""Hyperparameter search over real `hpcml train` runs (Optuna): the study and its workers
(`study`), the search space (`space`), one trial's run (`trial`, started from a worker's warm
`launcher` under a one-thread `guard`), planner feasibility
(`feasible`), MLflow parent and child runs (`tracking`) and the study's summary and report
page (`report`)."""

import warnings

import optuna

# Heartbeats, stale-trial retries and retry histories are marked experimental since Optuna 2.8;
# hpcml relies on them knowingly, so their warning on every call says nothing to a user.
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
