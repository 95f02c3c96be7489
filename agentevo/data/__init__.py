"""Trajectories, the experience store and training tensors."""
