"""online-sao: online learning from live LLM traffic with SAO."""

__version__ = "0.1.0"
