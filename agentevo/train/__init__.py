"""agentevo.train"""
