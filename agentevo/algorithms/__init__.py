"""agentevo.algorithms"""
