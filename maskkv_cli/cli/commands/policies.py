"""``maskkv policies``: the registered KV-cache policies, one line each."""

from __future__ import annotations

import typer

from maskkv_cli.defaults import DEFAULT_POLICY


def policies() -> None:
    """List the KV-cache policies with a one-line description each."""
    from maskkv_cli.policies.base import REGISTRY, policy_names

    for name in policy_names():
        summary = REGISTRY[name].summary + (" [default]" if name == DEFAULT_POLICY else "")
        typer.echo(f"{name:20s} {summary}")
