"""OVQ-attention (seed 000): growth schedules, no-grad routing, snapshot state build."""
from .routing import GROWTHS, SEEDINGS, dictionary_sizes, route_ovq
from .state import OVQSnapshots, build_ovq_snapshots

__all__ = ["GROWTHS", "SEEDINGS", "OVQSnapshots", "build_ovq_snapshots", "dictionary_sizes", "route_ovq"]
