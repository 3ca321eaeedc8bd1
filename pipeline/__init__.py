"""MERIT pipeline: conflict-aware decentralized instruction tuning of Qwen2.5-VL."""
