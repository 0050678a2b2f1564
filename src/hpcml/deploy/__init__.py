"""Deployment decisions over the registry: promote a candidate only when a paired test on the
same held-out samples shows it better and its gates pass (`promote`, `stats`)."""
