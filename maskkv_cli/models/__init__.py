"""Model families (LLaDA, Dream, LLaDA-MoE, LLaDA2, DiffusionGemma), their configs, and loading/saving in the upstream
checkpoint layout."""
