"""How many rows the prefill computes at once: its activations are bounded by these, whatever the prompt's length
(``engine/prefill.py`` runs them; ``engine/batch_memory.py`` counts them without importing torch)."""

MLP_CHUNK = 2048  # rows of the MLP (and of the k/v projections) computed at once in the prefill
QUERY_CHUNK = 512  # query rows of the prefill's attention, output projection and residual computed at once
# The fewest rows of prefills joined in one pass (``engine.prefill.join_rows`` decides how many, per model): the
# floor for models whose layers weigh less than this many rows' activations (tiny ones; docs/performance.md).
JOIN_ROWS = 1024
