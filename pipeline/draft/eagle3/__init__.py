"""EAGLE-3 heads: the model, both checkpoint layouts, and per-request drafting (docs/eagle3.md)."""

from pipeline.draft.eagle3.checkpoint import load_eagle3_head
from pipeline.draft.eagle3.drafter import Eagle3Drafter, HeadDrafts, HeadStep
from pipeline.draft.eagle3.head import Eagle3Config, Eagle3Head, default_aux_layers

__all__ = ["Eagle3Config", "Eagle3Drafter", "Eagle3Head", "HeadDrafts", "HeadStep",
           "default_aux_layers", "load_eagle3_head"]
