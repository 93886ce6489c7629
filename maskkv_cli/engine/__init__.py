"""The cache engine: layer-streamed prefill with eviction, a ragged per-head cache, response-only steps."""
