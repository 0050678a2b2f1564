"""Which served models generate text, and their generation services.

A model whose newest version is a zoo `gpt` export over bytes (`task: language_modeling`,
vocabulary 256: what `hpcml train` makes from byte-level token data) also answers
`/v1/completions`, `/v1/chat/completions` and the OIP generate extension. Its weights are loaded a second time, in the server process, for the
engine; the OIP endpoint keeps its own copy.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry

from hpcml.models.export import load_export, read_export_meta
from hpcml.models.gpt import GPT
from hpcml.serve.config import ServeConfig
from hpcml.serve.generate.engine import EngineConfig
from hpcml.serve.generate.sampling import ByteTokenizer
from hpcml.serve.generate.service import GenerationMetrics, GenerationService
from hpcml.serve.router import Router

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
        prefix_sharing=g.prefix_sharing,
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
        if model.cfg.vocab_size != ByteTokenizer.vocab_size:
            log.warning(
                "model %r is a language model over %d tokens, not bytes (256): it is served "
                "over OIP only, without /v1/completions.",
                name,
                model.cfg.vocab_size,
            )
            continue
        if g.quantize == "int8":
            from hpcml.serve.generate.quantize import quantize_int8

            quantize_int8(model)
        metrics = metrics or GenerationMetrics(registry)
        services[name] = GenerationService(name, model, engine_config, metrics, mv.version)
    return services
