"""A zoo gpt model saved as an hpcml export that `hpcml serve` runs through its LLM engine
(task language_modeling, int64 token ids in, one logit row per position out), shared by the
text-generation tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from hpcml.models.export import save_export


def save_gpt_export(out_dir: Path, model: nn.Module, args: dict[str, Any]) -> Path:
    """`model` built from the zoo's gpt with `args`; the export's shapes follow its context
    length (max_seq_len) and vocabulary (vocab_size)."""
    seq, vocab = int(args["max_seq_len"]), int(args["vocab_size"])
    return save_export(
        out_dir,
        model,
        "gpt-tiny",
        args,
        (seq,),
        (seq, vocab),
        input_dtype="int64",
        task="language_modeling",
    )
