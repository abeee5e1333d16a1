"""Validation of the simulator against the NestPipe paper at 1,536 workers.

INPUTS (the only paper numbers the model sees): the TorchRec breakdown at 1,536 workers, step 5793.83 ms,
lookup 2870.99 ms, All2All 1207.85 ms (``calibration.PAPER_TORCHREC_1536``), plus the public setting (batch 512
per worker, 8 micro-batches) in the ``paper-hstu`` workload preset.
PREDICTED (never fed in; held out here only as targets): NestPipe step 1895.98 ms and its 3.06x speedup, the 2D-SP
step 4914.01 ms, the All2All of 16-sample micro-batches without clustering (1331 ms), the lookup share 24.4% at
128 workers. Targets the honest model misses are strict xfails stating the achieved error (docs/planning.md).

The mechanism that the 2D-SP and micro-batch-16 predictions rest on: the TorchRec baselines (``off``, ``2dsp``)
exchange one row per token (EmbeddingCollection without index dedup) and look up every received index, while
NestPipe exchanges each micro-batch's distinct rows. Negative controls run NestPipe with the TorchRec exchange and
2D-SP with NestPipe's, and both miss.
"""

import dataclasses

import pytest

from nestpipe.planning import load_hardware, load_workload
from nestpipe.planning.calibration import PAPER_TORCHREC_1536, calibrate
from nestpipe.planning.cost_model import Scenario
from nestpipe.planning.simulate import predict

# held-out targets (paper); not used by any model code
NESTPIPE_STEP_MS = 1895.98
NESTPIPE_SPEEDUP = 3.06
TWOD_SP_STEP_MS = 4914.01
MB16_ALL2ALL_MS = 1331.0
LOOKUP_SHARE_128 = 0.244
LOOKUP_SHARE_1536 = 0.496


@pytest.fixture(scope="module")
def model():
    wl, hw = load_workload("paper-hstu"), load_hardware("ascend-910b")
    return wl, hw, calibrate(wl, hw, PAPER_TORCHREC_1536)


def rel(a, b):
    return abs(a - b) / b


def test_calibration_reproduces_its_inputs(model):
    wl, hw, s = model
    p = predict(wl, hw, Scenario(1536, "off"), s)
    assert p.step_ms == pytest.approx(5793.83, rel=1e-6)
    assert p.exposed_lookup_ms == pytest.approx(2870.99, rel=1e-6)
    assert p.exposed_comm_ms == pytest.approx(1207.85, rel=1e-6)
    assert p.exposed_lookup_ms / p.step_ms == pytest.approx(LOOKUP_SHARE_1536, abs=0.005)


def test_nestpipe_step_and_speedup_predicted_within_10_percent(model):
    wl, hw, s = model
    p = predict(wl, hw, Scenario(1536, "nested"), s)
    assert rel(p.step_ms, NESTPIPE_STEP_MS) < 0.10, p
    assert rel(5793.83 / p.step_ms, NESTPIPE_SPEEDUP) < 0.10
    # mechanism: FWP leaves about 2 of the 2N All2Alls exposed, DBP hides the lookup
    assert p.exposed_comm_ms < 0.25 * p.all2all_total_ms
    assert p.exposed_lookup_ms < 0.01 * p.step_ms


def test_negative_control_without_fwp_overlap_the_prediction_misses(model):
    wl, hw, s = model
    p = predict(wl, hw, Scenario(1536, "nested", fwp_overlap=False), s)
    assert rel(p.step_ms, NESTPIPE_STEP_MS) > 0.12, p


def test_negative_control_nestpipe_with_the_torchrec_exchange_misses(model):
    wl, hw, s = model
    p = predict(wl, hw, Scenario(1536, "nested", exchange="token"), s)
    assert rel(p.step_ms, NESTPIPE_STEP_MS) > 0.30, p


def test_negative_control_without_dbp_the_prediction_misses(model):
    wl, hw, s = model
    p = predict(wl, hw, Scenario(1536, "fwp"), s)
    assert rel(p.step_ms, NESTPIPE_STEP_MS) > 0.15, p


def test_prediction_depends_on_the_calibration_input(model):
    wl, hw, _ = model
    other = dataclasses.replace(PAPER_TORCHREC_1536, lookup_ms=1000.0, step_ms=3921.84)
    p = predict(wl, hw, Scenario(1536, "nested"), calibrate(wl, hw, other))
    assert p.step_ms == pytest.approx(predict(wl, hw, Scenario(1536, "nested"), model[2]).step_ms, rel=0.02)
    slower = dataclasses.replace(PAPER_TORCHREC_1536, comm_ms=2415.7, step_ms=7001.68)
    q = predict(wl, hw, Scenario(1536, "nested"), calibrate(wl, hw, slower))
    assert q.all2all_total_ms > 1.4 * p.all2all_total_ms and q.step_ms > p.step_ms + 10


def test_2dsp_step_within_10_percent(model):
    wl, hw, s = model
    p = predict(wl, hw, Scenario(1536, "2dsp"), s)
    assert rel(p.step_ms, TWOD_SP_STEP_MS) < 0.10, p
    # mechanism: the group's All2All stays inside a node, the replica sync of the touched rows is cheap
    assert p.group_size < 1536 and p.exposed_comm_ms < 0.5 * 1207.85


def test_negative_control_2dsp_with_the_unique_exchange_misses(model):
    wl, hw, s = model
    p = predict(wl, hw, Scenario(1536, "2dsp", exchange="unique"), s)
    assert rel(p.step_ms, TWOD_SP_STEP_MS) > 0.30, p


def test_micro_batch_16_unclustered_all2all_within_10_percent(model):
    wl, hw, s = model
    p = predict(wl, hw, Scenario(1536, "nested", micro_batches=32, clustered=False), s)
    assert rel(p.all2all_total_ms, MB16_ALL2ALL_MS) < 0.10, p


def test_negative_control_micro_batch_16_with_the_torchrec_exchange_misses(model):
    wl, hw, s = model
    p = predict(wl, hw, Scenario(1536, "nested", micro_batches=32, clustered=False, exchange="token"), s)
    assert rel(p.all2all_total_ms, MB16_ALL2ALL_MS) > 0.30, p


def test_micro_batch_16_all2all_inflates_and_clustering_deflates(model):
    wl, hw, s = model
    base = predict(wl, hw, Scenario(1536, "nested"), s).all2all_total_ms  # 8 clustered micro-batches of 64
    raw = predict(wl, hw, Scenario(1536, "nested", micro_batches=32, clustered=False), s).all2all_total_ms
    clu = predict(wl, hw, Scenario(1536, "nested", micro_batches=32, clustered=True), s).all2all_total_ms
    assert raw > clu > base


@pytest.mark.xfail(strict=True, reason="model predicts 55.0% at 128 workers (+30.6 points): per-owner lookups do "
                                       "not grow with the worker count under weak scaling (docs/planning.md)")
def test_lookup_share_at_128_within_5_points(model):
    wl, hw, s = model
    p = predict(wl, hw, Scenario(128, "off"), s)
    assert abs(p.exposed_lookup_ms / p.step_ms - LOOKUP_SHARE_128) < 0.05, p


def test_all2all_grows_with_workers(model):
    wl, hw, s = model
    a = [predict(wl, hw, Scenario(w, "off"), s).exposed_comm_ms for w in (16, 128, 1536, 4096)]
    assert a == sorted(a) and a[-1] > 2 * a[0]
