"""moe-rl: reinforcement learning of Mixture-of-Experts language models on megatron-core.

``import moe_rl`` is cheap: it needs only torch-free modules; megatron-core, triton and
sglang are imported inside the modules that use them.
"""

__version__ = "0.1.0"
