"""Fault tolerance of the training loop: the guard (`guard.FaultGuard`) and its hook, the
non-finite and spike policies, the hang watchdog, stop signals and preemption notices,
stragglers, and fault injection for tests."""
