"""Helpers that run model servers for tests and the local stack (tritonserver launcher)."""
