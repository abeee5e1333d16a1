"""Online ranking with a trained HSTU run: :class:`~nestpipe.serving.ranker.Ranker` (prefix K/V cache) and the
HTTP service of ``nestpipe serve`` (:mod:`nestpipe.serving.server`)."""

from nestpipe.serving.ranker import Events, PrefixCache, Ranker

__all__ = ["Events", "PrefixCache", "Ranker"]
