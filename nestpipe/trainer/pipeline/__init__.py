"""The nested pipeline: the five-stage Dual-Buffer Pipeline between batches (:mod:`.dual_buffer`, :mod:`.scheduler`)
and the Frozen-Window Pipeline inside a batch (:mod:`.frozen_window`); see ``docs/pipeline.md``."""
