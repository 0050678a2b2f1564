"""hpcml: plan, feed, train, track, serve, watch and launch ML workloads on HPC hardware."""

__version__ = "0.1.0"
