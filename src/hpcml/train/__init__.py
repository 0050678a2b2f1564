"""hpcml.train."""
