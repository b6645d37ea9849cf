"""Drafting behind one interface: `Proposer` (n-gram lookup, a draft model, or none)."""

from pipeline.proposers.base import Proposal, Proposer
from pipeline.proposers.none import NoProposer

__all__ = ["NoProposer", "Proposal", "Proposer"]
