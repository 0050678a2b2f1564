"""Text generation for the zoo's `gpt`: paged KV cache, continuous batching, sampling, and the
OpenAI-compatible `/v1/completions` endpoint of `hpcml serve`."""
