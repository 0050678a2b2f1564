"""hpcml.dist."""
