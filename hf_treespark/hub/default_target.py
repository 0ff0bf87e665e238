"""The offline default target's names: what it is called locally, on the Hub, and in the cache."""

DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"
DEFAULT_TARGET_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the same model on the Hub
DEFAULT_TARGET_CACHE_NAME = "smollm2-135m-instruct"  # its converted copy under storage.cache_dir()
