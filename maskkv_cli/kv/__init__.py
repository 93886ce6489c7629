"""The prompt KV cache: per-head budgets (pure functions), mask-query votes, the ragged per-layer cache and
residual entries. Nothing here knows about policies, the engine or a model class."""
