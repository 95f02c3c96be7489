"""agentevo.rollout"""
