"""llmd: a local LLM inference daemon built for latency."""

__version__ = "0.1.0"
