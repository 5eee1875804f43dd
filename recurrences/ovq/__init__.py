"""OVQ-attention (OVQ paper, arXiv 2602.03922): growth schedules, no-grad routing, snapshot state build."""
from ..compiling import ROUTING_IMPLS
from .routing import (GROWTHS, SEEDINGS, DictionarySchedule, dictionary_size, dictionary_sizes, ovq_absorb,
                      ovq_route_chunk, route_ovq, seeding_draw)
from .state import build_ovq_snapshots, build_ovq_versioned

__all__ = ["GROWTHS", "ROUTING_IMPLS", "SEEDINGS", "DictionarySchedule", "build_ovq_snapshots", "build_ovq_versioned",
           "dictionary_size", "dictionary_sizes", "ovq_absorb", "ovq_route_chunk", "route_ovq", "seeding_draw"]
