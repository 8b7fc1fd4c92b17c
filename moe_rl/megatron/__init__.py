"""megatron."""
