"""triage-proxy: an OpenAI-compatible reverse proxy that decides which LLM call goes first."""

__version__ = "0.4.0"
