"""The verify stage: target logits over the drafted positions, acceptance, the VerifyStep message."""
