"""The Prometheus metrics of the text generation services (one set per server, a `model`
label each), in the server's registry; `service.GenerationService` updates them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TOKEN_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
REQUEST_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class GenerationMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.ttft = Histogram(
            "hpcml_llm_time_to_first_token_seconds",
            "From a completion request's arrival to its first generated token.",
            ["model"],
            buckets=TOKEN_BUCKETS_S,
            registry=registry,
        )
        self.itl = Histogram(
            "hpcml_llm_inter_token_latency_seconds",
            "Between two consecutive generated tokens of one request.",
            ["model"],
            buckets=TOKEN_BUCKETS_S,
            registry=registry,
        )
        self.tokens = Counter(
            "hpcml_llm_output_tokens", "Generated tokens.", ["model"], registry=registry
        )
        self.preemptions = Counter(
            "hpcml_llm_preemptions",
            "Sequences preempted for KV blocks (recomputed later).",
            ["model"],
            registry=registry,
        )
        self.sequences = Gauge(
            "hpcml_llm_sequences",
            "Sequences in the engine, by state (running, waiting).",
            ["model", "state"],
            registry=registry,
        )
        self.kv_blocks_used = Gauge(
            "hpcml_llm_kv_cache_blocks_used",
            "KV cache blocks in use.",
            ["model"],
            registry=registry,
        )
        self.kv_blocks = Gauge(
            "hpcml_llm_kv_cache_blocks", "KV cache blocks in all.", ["model"], registry=registry
        )
        self.latency = Histogram(
            "hpcml_llm_request_duration_seconds",
            "From a completion request's arrival to its last token (requests that finished).",
            ["model"],
            buckets=REQUEST_BUCKETS_S,
            registry=registry,
        )
        self.queue_time = Histogram(
            "hpcml_llm_queue_time_seconds",
            "From a completion request's arrival to its first step in the engine.",
            ["model"],
            buckets=REQUEST_BUCKETS_S,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "hpcml_llm_prompt_tokens",
            "Prompt tokens of accepted requests.",
            ["model"],
            registry=registry,
        )
        self.prefix_hits = Counter(
            "hpcml_llm_prefix_cache_hit_tokens",
            "Tokens of admitted sequences found in the prefix cache (not computed); the hit "
            "rate is its rate over hpcml_llm_prefix_cache_query_tokens.",
            ["model"],
            registry=registry,
        )
        self.prefix_queries = Counter(
            "hpcml_llm_prefix_cache_query_tokens",
            "Tokens of admitted sequences (recomputed ones again), looked up in the prefix cache.",
            ["model"],
            registry=registry,
        )
        self.batch_size = Histogram(
            "hpcml_llm_batch_size",
            "Sequences in one engine step.",
            ["model"],
            buckets=BATCH_BUCKETS,
            registry=registry,
        )
        self.refused = Counter(
            "hpcml_llm_refused_requests",
            "Requests answered 429 because max_waiting requests already waited.",
            ["model"],
            registry=registry,
        )
        self.restarts = Counter(
            "hpcml_llm_engine_restarts",
            "Engine processes started again after one died.",
            ["model"],
            registry=registry,
        )
