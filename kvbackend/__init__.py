"""kvbackend: a compressed, tiered, paged KV-cache backend for LLM and video serving engines."""

from . import codecs
from .errors import CacheFull, InvalidKV, KVBackendError, SpecError, UnknownRequest
from .geometry import CacheConfig, Geometry
from .layout import PageLayout
from .manager import CacheStats, KVCache

__version__ = "0.1.0"

__all__ = ["codecs", "CacheConfig", "CacheFull", "CacheStats", "Geometry", "InvalidKV", "KVBackendError", "KVCache",
           "PageLayout", "SpecError", "UnknownRequest", "__version__"]
