"""``maskkv policies``: the registered KV-cache policies, one line each (or as JSON)."""

from __future__ import annotations

import json

import typer

from maskkv_cli.cli.options import JsonOpt
from maskkv_cli.defaults import DEFAULT_POLICY


def policies(as_json: JsonOpt = False) -> None:
    """List the KV-cache policies with a one-line description each.

    Examples:

        maskkv policies

        maskkv policies --json
    """
    from maskkv_cli.policies.base import REGISTRY, policy_names

    if as_json:
        typer.echo(json.dumps({"policies": [
            {"name": name, "summary": REGISTRY[name].summary, "evicts": REGISTRY[name].evicts,
             "default": name == DEFAULT_POLICY} for name in policy_names()]}))
        return
    for name in policy_names():
        summary = REGISTRY[name].summary + (" [default]" if name == DEFAULT_POLICY else "")
        typer.echo(f"{name:20s} {summary}")
