"""agentevo.eval"""
