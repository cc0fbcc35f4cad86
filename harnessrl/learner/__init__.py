"""Learner stage: mesh and sharding rules, losses, optimizer, sharded train step, checkpoints."""
