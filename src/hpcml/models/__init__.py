"""Model zoo: name -> builder, input spec, parameter and FLOP counts."""

from hpcml.models.zoo import ModelSpec, build_model, get_spec, list_models, register

__all__ = ["ModelSpec", "build_model", "get_spec", "list_models", "register"]
