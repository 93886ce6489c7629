"""How many rows the prefill computes at once: its activations are bounded by these, whatever the prompt's length
(``engine/forward.py`` runs them; ``engine/batch_memory.py`` counts them without importing torch)."""

MLP_CHUNK = 2048  # rows of the MLP (and of the k/v projections) computed at once in the prefill
QUERY_CHUNK = 512  # query rows of the prefill's attention, output projection and residual computed at once
# Rows of prefills joined in one pass (``sampling/driver.py``): prompts are joined while their rows together stay
# within this; a longer prompt's prefill runs on its own. Joining shares each weight's read among short prompts
# (llada-small, one thread: 8 prompts of 32 tokens joined took 0.71x their time alone, of 128 tokens 0.95x, of 512
# 0.99x); longer runs of rows only grow the activations, which can cost more than they share where the weights are
# small (the embedded model, 8 prompts of 1.4k-1.7k tokens: their prefills took 1.3x their time alone). Chosen
# in docs/performance.md, "Which prefills are joined".
JOIN_ROWS = 512
