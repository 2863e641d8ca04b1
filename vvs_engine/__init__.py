"""vvs-engine: fast autoregressive image generation with speculative decoding."""
from .startup import quiet_interrupts_while_starting

quiet_interrupts_while_starting()  # first: the imports below take seconds (torch)

from .engine import Engine, GenerationOutput  # noqa: F401
from .errors import VVSError  # noqa: F401
from .sampling import SamplingParams  # noqa: F401

__version__ = "0.1.0"
