"""Dream's sampler under the name docs/api.md gives it; it lives in ``maskkv_cli.sampling.dream``."""

from maskkv_cli.sampling.dream import DREAM_ALGS, DreamGenerationConfig, DreamOptions, generate_dream

__all__ = ["DREAM_ALGS", "DreamGenerationConfig", "DreamOptions", "generate_dream"]
