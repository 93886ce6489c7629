"""The application layer: a run's settings (``run_settings.py``), a loaded model and tokenizer answering prompts
(``session.py``) and the core use case, a document and a question to an answer (``pipeline.py``). Layered in that
order: pipeline imports session, and neither imports upward (the contracts in ``pyproject.toml``)."""
