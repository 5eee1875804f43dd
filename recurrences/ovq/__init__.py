"""OVQ-attention (seed 000): growth schedules, no-grad routing, snapshot state build."""
from .routing import GROWTHS, SEEDINGS, dictionary_size, dictionary_sizes, ovq_absorb, ovq_route_chunk, route_ovq, seeding_draw
from .state import OVQSnapshots, build_ovq_snapshots

__all__ = ["GROWTHS", "SEEDINGS", "OVQSnapshots", "build_ovq_snapshots", "dictionary_size", "dictionary_sizes", "ovq_absorb",
           "ovq_route_chunk", "route_ovq", "seeding_draw"]
