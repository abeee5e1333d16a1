"""Measuring this trainer's runs (above the trainer): fit the cost model to a measured ``--pipeline off`` run
(:mod:`.measured`, :mod:`.dense_probe`), train configurations and compare them with their predictions
(:mod:`.validate_local`), and run several trainings in one launch of the ranks (:mod:`.launcher`); fit the ingest's
per-sequence cost model on this machine (:mod:`.sequence_cost`, ``nestpipe measure sequence-cost``)."""
