"""Which served models generate text, and their generation services.

A model whose newest version is a zoo `gpt` export (`task: language_modeling`) also answers
`/v1/completions`, `/v1/chat/completions` and the OIP generate extension when its text has a
tokenizer: the one its model.json records (a GPT-2 `tokenizer.json` copied by `hpcml model
import-hf`; its vocabulary must not exceed the model's), else UTF-8 bytes for a vocabulary of
256 (what `hpcml train` makes from byte-level token data). Any other vocabulary is served over
OIP token ids only. The server loads the export once to check it (a bad one fails before the
server starts) and lets it go; the engine process (`engine_process`) loads its own copy, and
the OIP endpoint keeps its own.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from hpcml.errors import ModelError
from hpcml.models.export import load_export, read_export_meta
from hpcml.models.gpt import GPT
from hpcml.models.tokenizer import FILE, Tokenizer, export_tokenizer
from hpcml.serve.config import ServeConfig
from hpcml.serve.generate.engine import EngineConfig
from hpcml.serve.generate.engine_process import EngineSpec
from hpcml.serve.generate.llm_metrics import GenerationMetrics
from hpcml.serve.generate.sampling import ByteTokenizer
from hpcml.serve.generate.service import GenerationService
from hpcml.serve.traffic.router import Router

log = logging.getLogger(__name__)


def text_services(
    router: Router, config: ServeConfig, registry: CollectorRegistry
) -> dict[str, GenerationService]:
    g = config.generation
    engine_config = EngineConfig(
        kv_cache_blocks=g.kv_cache_blocks,
        block_size=g.block_size,
        max_num_seqs=g.max_num_seqs,
        max_batched_tokens=g.max_batched_tokens,
        max_prefill_tokens=g.max_prefill_tokens,
        prefix_sharing=g.prefix_sharing,
        watermark_blocks=g.watermark_blocks,
        max_preemptions=g.max_preemptions,
        kv_overcommit=g.kv_overcommit,
        static_batching=g.static_batching,
    )
    services: dict[str, GenerationService] = {}
    metrics: GenerationMetrics | None = None
    for name, served in router.models.items():
        mv = served.newest
        meta = read_export_meta(mv.export_dir)
        if meta.get("task") != "language_modeling":
            continue
        model, _ = load_export(mv.export_dir, trust_code=router.trust_code)
        if not isinstance(model, GPT):
            continue
        tokenizer = tokenizer_of(name, mv.export_dir, meta, int(model.cfg.vocab_size))
        if tokenizer is None:
            continue
        spec = EngineSpec(
            name,
            str(mv.export_dir),
            engine_config,
            tokenizer,
            trust_code=router.trust_code,
            quantize=g.quantize,
            threads=config.for_model(name).threads,
        )
        metrics = metrics or GenerationMetrics(registry)
        services[name] = GenerationService(
            spec,
            int(model.cfg.max_seq_len),
            metrics,
            mv.version,
            g.step_timeout_s,
            max_waiting=g.max_waiting,
            request_timeout_s=g.request_timeout_s,
        )
    return services


def tokenizer_of(name: str, export_dir: Path, meta: dict[str, Any], vocab: int) -> Tokenizer | None:
    """The tokenizer of a served language model; None (with a warning) when it has none."""
    tokenizer = export_tokenizer(export_dir, meta)
    if tokenizer is not None:
        if tokenizer.vocab_size > vocab:
            raise ModelError(
                f"{export_dir / FILE} has {tokenizer.vocab_size} tokens, more than model "
                f"{name!r}'s vocabulary of {vocab}; give the tokenizer saved with the model."
            )
        return tokenizer
    if vocab == ByteTokenizer.vocab_size:
        return ByteTokenizer()
    log.warning(
        "model %r is a language model over %d tokens, not bytes (256), and its export records "
        "no tokenizer: it is served over OIP only, without /v1/completions.",
        name,
        vocab,
    )
    return None
