"""agentevo.models"""
