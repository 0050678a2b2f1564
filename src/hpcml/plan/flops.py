"""Published FLOP counts of transformer training: PaLM's per-token count and Megatron-LM's
per-iteration and parameter formulas (used by `plan.shapes` and checked by its tests)."""

from __future__ import annotations

from hpcml.plan.common import PlanError


def palm_flops_per_token(n_params: float, layers: int, hidden: int, seq: int) -> float:
    """Training FLOPs per token: 6N + 12*L*H*Q*T (PaLM, Chowdhery et al. 2022, Appendix B).

    H*Q (heads x head size) is the attention width, the hidden size for standard blocks;
    the 12*L*H*Q*T term is the attention scores and the weighted sum over T tokens.
    """
    return 6.0 * n_params + 12.0 * layers * hidden * seq


def megatron_flops_per_iteration(
    batch: int, seq: int, layers: int, hidden: int, vocab: int, recompute: str = "none"
) -> float:
    """Megatron-LM's FLOPs per iteration of B sequences.

    none (model FLOPs), Korthikanti et al. 2022 Eq. 7: 72BLsh^2 (1 + s/(6h) + V/(12hL));
    attention-scores (their "selective" recomputation), their Eq. 8: 72BLsh^2 (1 + s/(3h) + V/(12hL));
    full, Narayanan et al. 2021 Eq. 3: 96BLsh^2 (1 + s/(6h) + V/(16hL)).
    """
    b, s, lyr, h, v = float(batch), float(seq), float(layers), float(hidden), float(vocab)
    base = 72.0 * b * lyr * s * h * h
    if recompute == "none":
        return base * (1 + s / (6 * h) + v / (12 * h * lyr))
    if recompute == "attention-scores":
        return base * (1 + s / (3 * h) + v / (12 * h * lyr))
    if recompute == "full":
        return 96.0 * b * lyr * s * h * h * (1 + s / (6 * h) + v / (16 * h * lyr))
    raise PlanError(f"recompute '{recompute}' is not known; use none, attention-scores or full.")


def megatron_params(layers: int, hidden: int, vocab: int, seq: int) -> float:
    """GPT parameter count, Narayanan et al. 2021 Eq. 2: 12lh^2 (1 + 13/(12h) + (V+s)/(12lh))."""
    h, lyr = float(hidden), float(layers)
    return 12 * lyr * h * h * (1 + 13 / (12 * h) + (vocab + seq) / (12 * lyr * h))
