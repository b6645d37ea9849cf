"""Training an EAGLE-3 head on the target's own greedy generations (scripts/train_eagle3.py)."""
