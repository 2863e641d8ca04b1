from .gpt import GPT, GPTConfig, gpt_config, GPT_PRESETS  # noqa: F401
from .vq import VQModel, VQConfig, VQ_PRESETS  # noqa: F401
