"""llmserve: a streaming LLM text-generation server over a paged KV cache."""

from llmserve.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the engine; import it lazily so `import llmserve` stays light.
    if name == "LLM":
        from llmserve.engine.llm import LLM

        return LLM
    raise AttributeError(name)
