"""Launchers: local torchrun, SLURM, Kubernetes."""
