"""MERIT pipeline: conflict-aware decentralized instruction tuning of Qwen2.5-VL."""

from pipeline.threads import configure_environment

configure_environment()  # before any module of the package imports torch (pipeline.threads says why)
