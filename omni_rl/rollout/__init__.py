"""Generation engines: hf (CPU and GPU; shares the policy's weights)."""
