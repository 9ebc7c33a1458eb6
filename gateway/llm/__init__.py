"""Client side of the speech-token LLM server: CosyVoice2 prompts and the streaming completions client."""
