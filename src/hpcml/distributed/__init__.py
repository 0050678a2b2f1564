"""Everything that touches torch.distributed: process groups, devices, wrapping, precision."""
