"""OpenAI-compatible speech gateway: HTTP API, audio encoding, voices and the LLM → token2wav pipeline."""
