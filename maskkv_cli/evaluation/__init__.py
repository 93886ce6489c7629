"""maskkv in EleutherAI's lm-evaluation-harness (the optional extra ``maskkv[eval]``).

The harness (0.4.x) finds models only in its own table or through ``register_model`` in a module that has been
imported; it loads no plugins. ``register()`` imports ``harness_model``, which registers ``--model maskkv``;
``python -m maskkv_cli.evaluation`` is the harness's own command line with the model registered (use it in place
of ``lm_eval``, also as ``accelerate launch -m maskkv_cli.evaluation``), and ``maskkv eval`` wraps the harness's
Python API.
"""

from __future__ import annotations

INSTALL_HINT = "the evaluation harness is not installed; run: pip install 'maskkv[eval]'"


def harness_available() -> bool:
    """Whether ``lm_eval`` can be imported."""
    import importlib.util

    return importlib.util.find_spec("lm_eval") is not None


def register() -> None:
    """Register ``maskkv`` with the harness's model registry (raises ``UsageError`` naming the extra when the
    harness is missing)."""
    if not harness_available():
        from maskkv_cli.errors import UsageError

        raise UsageError(INSTALL_HINT)
    import maskkv_cli.evaluation.harness_model  # noqa: F401  (its decorator registers the model)
