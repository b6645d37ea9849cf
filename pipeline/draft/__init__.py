"""The draft stage: proposers behind one interface (`Proposer`: n-gram lookup, a draft model, none)."""

from pipeline.draft.base import Proposal, Proposer
from pipeline.draft.none import NoProposer

__all__ = ["NoProposer", "Proposal", "Proposer"]
