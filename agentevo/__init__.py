"""agentevo: LLM agents that improve from their own experience."""

__version__ = "0.1.0"
