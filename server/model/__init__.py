"""The policy-model participant kind."""
