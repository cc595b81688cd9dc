"""gyre-ray: elastic, Ray-native reinforcement learning for extra-long-horizon LLM agents."""

__version__ = "0.1.0"
