"""Recomputation (activation checkpointing) policies, named as the stacks that run them name them.
`hpcml train` (train.activation_checkpointing) and `hpcml plan` (--recompute) take the same names:

- `none`: every block keeps what its backward needs.
- `full`: every block keeps its input only and runs its forward again in backward
  (Megatron-LM's full recomputation, torchtitan's `mode: full`).
- `op`: torchtitan's selective op checkpointing (torchtitan/distributed/activation_checkpoint.py,
  `_custom_policy`): each block saves the output of the attention kernel and of every other
  matmul (the 1st, 3rd, ...; the count restarts in each block) and recomputes the rest.
- `layer:K`: the 1st, (K+1)-th, ... block recomputed in full, the others keep everything
  (torchtitan's selective_ac_option "K" counts from the K-th; hpcml counts from the first).
- `attention-scores`: Korthikanti et al. 2022's selective recomputation: the s x s softmax
  scores (and their dropout) are recomputed. Only eager attention keeps them; a fused kernel
  (sdpa, flash) never does, so the policy is refused there rather than planned as a saving.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hpcml.plan.common import PlanError

NAMES = ("none", "full", "op", "layer:K", "attention-scores")


@dataclass(frozen=True)
class Policy:
    kind: str
    """none, full, op, layer or attention-scores."""
    every: int = 0
    """layer:K's K."""

    def recomputed_blocks(self, layers: int) -> int:
        """Blocks recomputed in full out of `layers` (op recomputes inside every block)."""
        if self.kind == "full":
            return layers
        if self.kind == "layer":
            return math.ceil(layers / self.every)
        return 0

    @property
    def recomputes_blocks(self) -> bool:
        """A block runs its forward again in backward (its whole activations alive then)."""
        return self.kind in ("full", "layer", "op")


def parse(text: str) -> Policy:
    """A policy by name; one sentence for a name that is not one."""
    name = str(text).strip()
    if name == "selective":
        raise PlanError(
            "recompute 'selective' names three different policies; say which: "
            "attention-scores (Korthikanti's: drop the s x s scores), op (torchtitan's "
            "selective op checkpointing) or layer:K (every K-th block in full)."
        )
    if name.startswith("layer:"):
        k = name.partition(":")[2]
        if not k.isdigit() or int(k) < 1:
            raise PlanError(
                f"recompute '{name}': K in layer:K must be a whole number of at least 1, e.g. "
                "layer:2."
            )
        return Policy("layer", int(k))
    if name in ("none", "full", "op", "attention-scores"):
        return Policy(name)
    raise PlanError(f"recompute '{name}' is not known; use one of {', '.join(NAMES)}.")


def check_attention(policy: Policy, attention: str) -> None:
    if policy.kind == "attention-scores" and attention != "eager":
        raise PlanError(
            f"recompute attention-scores saves the s x s scores that only eager attention keeps; "
            f"with {attention} attention there is nothing to drop, so use op, layer:K or full "
            "(or --attention eager)."
        )


def matmul_widths(hidden: int, kv_width: int, ffn: int, gated: bool) -> list[tuple[int, int]]:
    """(in, out) features of a block's matmuls in the order its forward runs them: separate
    q, k, v and output projections (torchtitan's Llama, Hugging Face's Llama, hpcml's gpt),
    then w1, w3, w2 for a gated MLP or fc, proj otherwise. A model that fuses q, k and v into
    one matmul (Megatron-LM, GPT-2) saves another set."""
    h = hidden
    attention = [(h, h), (h, kv_width), (h, kv_width), (h, h)]
    if gated:
        return [*attention, (h, ffn), (h, ffn), (ffn, h)]
    return [*attention, (h, ffn), (ffn, h)]


def op_saved_width(hidden: int, kv_width: int, ffn: int, gated: bool) -> int:
    """Features per token the op policy saves in a block: the 1st, 3rd, ... matmul outputs."""
    return sum(
        out for i, (_, out) in enumerate(matmul_widths(hidden, kv_width, ffn, gated)) if i % 2 == 0
    )


def op_recomputed_flops_per_token(hidden: int, kv_width: int, ffn: int, gated: bool) -> int:
    """Forward FLOPs per token of the matmuls the op policy recomputes (the 2nd, 4th, ...)."""
    mms = matmul_widths(hidden, kv_width, ffn, gated)
    return sum(2 * i * o for n, (i, o) in enumerate(mms) if n % 2 == 1)
