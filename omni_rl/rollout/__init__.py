"""Generation engines: hf (CPU and GPU) and, as an optional extra, vllm."""
