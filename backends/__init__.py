"""Code that runs inside or beside the model servers (token2wav engine, LLM helpers). Testable without Triton."""
