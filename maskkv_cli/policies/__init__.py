"""Eviction policies, registered by name (``--policy NAME``)."""

from maskkv_cli.policies import baselines, maskkv  # noqa: F401  (registration)
from maskkv_cli.policies.base import LayerView, Policy, PolicyOptions, get_policy, policy_names, register

__all__ = ["LayerView", "Policy", "PolicyOptions", "get_policy", "policy_names", "register"]
