"""UMIA (Unified Multi-Level Importance Arbitration): per token, layer and phase, how many of a token's top-k
experts are critical (WQ + WR) — decided inside the graph, parameterised by a `Policy`, calibrated offline
against a measured latency model. docs/umia.md has the formula and the method.
"""
from .policy import Policy, PolicyError, load_policy, policy_from_dict
from .stats import RHistogram

__all__ = ["Policy", "PolicyError", "RHistogram", "load_policy", "policy_from_dict"]
