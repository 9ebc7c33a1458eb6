"""Voice preparation: spk2info entries for token2wav and the LLM."""
