"""Orchestrator: the public Generate API; drives draft → verify rounds between the workers."""
