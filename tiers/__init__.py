"""Host and file tiers, prefetch and policies (installed as kvbackend.tiers)."""
