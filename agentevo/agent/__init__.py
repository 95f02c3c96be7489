"""agentevo.agent"""
