"""Cache-aware routing across a deployment's replicas: the cost model (``cost``) and the routing
policies (``policies``). Pure Python, no framework."""

from cachecore.routing.cost import TIERS, CostModel, Hit, Rates, ReplicaState
from cachecore.routing.policies import (
    ROUTING_POLICIES,
    ExpectedTTFT,
    LeastLoaded,
    NoReplicaError,
    Policy,
    RoundRobin,
    RouteRequest,
    SGLangRule,
)

__all__ = [
    "ROUTING_POLICIES",
    "TIERS",
    "CostModel",
    "ExpectedTTFT",
    "Hit",
    "LeastLoaded",
    "NoReplicaError",
    "Policy",
    "Rates",
    "ReplicaState",
    "RoundRobin",
    "RouteRequest",
    "SGLangRule",
]
