"""eaglespec: EAGLE speculative decoding (EAGLE-1 static trees, EAGLE-2 dynamic trees), exactly
lossless, on CPUs and GPUs.

    from eaglespec import EagleSpec
    engine = EagleSpec.load("smollm2-135m-instruct", draft="default")
    result = engine.generate("Why is the sky blue?", method="eagle2")
"""

__version__ = "0.1.0"

from .api import EagleSpec, GenerationResult  # noqa: E402

__all__ = ["EagleSpec", "GenerationResult", "__version__"]
