"""The draft stage: proposers behind one interface (`Proposer`)."""

from pipeline.draft.base import Proposal, Proposer
from pipeline.draft.none import NoProposer

__all__ = ["NoProposer", "Proposal", "Proposer"]
