"""The agent and environment participant kinds: episodes that advance step by step."""
