"""Engine adapters: transformers, SGLang, vLLM (installed as kvbackend.integration)."""
