"""kvbackend: a compressed, tiered, paged KV-cache backend for LLM and video serving engines."""

from kvbackend import codecs
from kvbackend.errors import CacheFull, InvalidKV, KVBackendError, SpecError, UnknownRequest
from kvbackend.geometry import CacheConfig, Geometry
from kvbackend.layout import PageLayout
from kvbackend.manager import CacheStats, KVCache

__version__ = "0.1.0"

__all__ = ["codecs", "CacheConfig", "CacheFull", "CacheStats", "Geometry", "InvalidKV", "KVBackendError", "KVCache",
           "PageLayout", "SpecError", "UnknownRequest", "__version__"]
