"""vvs-engine: fast autoregressive image generation with speculative decoding."""
from .engine import Engine, GenerationOutput  # noqa: F401
from .errors import VVSError  # noqa: F401
from .sampling import SamplingParams  # noqa: F401

__version__ = "0.1.0"
