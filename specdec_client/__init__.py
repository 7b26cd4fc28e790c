"""Client SDK for the specdec.v1.Orchestrator API (sync and asyncio)."""
from specdec_client.client import (AsyncSpecDecClient, Chunk, GenerationResult, SpecDecClient,
                                   SpecDecError, SpecStats)

__all__ = ["AsyncSpecDecClient", "Chunk", "GenerationResult", "SpecDecClient", "SpecDecError", "SpecStats"]
