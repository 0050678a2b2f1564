"""Hyperparameter search over real `hpcml train` runs (Optuna): the study and its workers
(`study`), the search space (`space`), one trial's run (`trial`), planner feasibility
(`feasible`) and the study's report (`report`)."""
