"""The sequential models' encoders (hstu, sasrec): causal (a token's state never depends on later tokens) and
independent of the other samples of the micro-batch (padding to the longest sample changes nothing); both share
the objective (``next_item_loss``). Negative control: without the causal mask a later token changes earlier
states."""

from __future__ import annotations

import math

import pytest
import torch

from nestpipe.trainer.models.common import init_parameters
from nestpipe.trainer.models.hstu import HSTU, HSTUConfig
from nestpipe.trainer.models.sasrec import SASRec, SASRecConfig

D, L = 16, 12


def _model(name):
    m = (HSTU(HSTUConfig(num_layers=2, num_heads=2, linear_dim=8, transition=0.0, item_bias=0.0), D, ["action", "item"], L)
         if name == "hstu"
         else SASRec(SASRecConfig(num_layers=2, num_heads=2, transition=0.0, item_bias=0.0), D, ["action", "item"], L))
    init_parameters(m, torch.Generator().manual_seed(0))
    with torch.no_grad():
        m.pos.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    return m.double()


def _emb(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    n = int(sum(lengths))
    return {"item": torch.randn(n, D, generator=g, dtype=torch.float64),
            "action": torch.randn(n, D, generator=g, dtype=torch.float64)}


@pytest.mark.parametrize("name", ["hstu", "sasrec"])
def test_encoder_is_causal_and_per_sample(name):
    m = _model(name)
    lengths = torch.tensor([5, 9, 3])
    emb = _emb(lengths.tolist(), 2)
    h = m.encode(emb, lengths)
    # alone in its micro-batch (no padding to 9), sample 0 gets the same states
    alone = m.encode({k: v[:5] for k, v in emb.items()}, lengths[:1])
    torch.testing.assert_close(alone, h[:5], rtol=1e-12, atol=1e-12)
    # a changed later token (sample 1, position 6) leaves positions 0..5 of sample 1 unchanged
    emb2 = {k: v.clone() for k, v in emb.items()}
    emb2["item"][5 + 6] += torch.linspace(-1, 1, D, dtype=torch.float64)  # not a constant shift (LayerNorm removes those)
    h2 = m.encode(emb2, lengths)
    torch.testing.assert_close(h2[5:5 + 6], h[5:5 + 6], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(h2[5 + 6], h[5 + 6])


def test_negative_control_sasrec_without_causal_mask_sees_the_future(monkeypatch):
    m = _model("sasrec")
    monkeypatch.setattr(torch, "tril", lambda x: torch.ones_like(x))  # every key visible
    lengths = torch.tensor([9])
    emb = _emb([9], 3)
    emb2 = {k: v.clone() for k, v in emb.items()}
    emb2["item"][6] += torch.linspace(-1, 1, D, dtype=torch.float64)
    assert not torch.allclose(m.encode(emb2, lengths)[:6], m.encode(emb, lengths)[:6])


def test_history_negatives_are_each_query_s_distinct_prefix_items_other_than_its_target():
    from nestpipe.trainer.models.common import _history_logits

    torch.manual_seed(0)
    lengths = torch.tensor([4, 3])
    item_ids = torch.tensor([7, 9, 7, 5, 3, 3, 8])  # sample 0: 7 9 7 5; sample 1: 3 3 8
    items = torch.randn(7, D, dtype=torch.float64)
    q_idx = torch.tensor([0, 1, 2, 4, 5])  # every position but each sample's last
    query = torch.nn.functional.normalize(torch.randn(5, D, dtype=torch.float64), dim=-1)
    got = _history_logits(query, items, item_ids, lengths, q_idx, 0.5)
    kept = (got > -1e8).tolist()
    # query at sample 0 pos 0 (target 9): {7}; pos 1 (target 7): {9} (7 is the target); pos 2 (target 5): {7, 9}
    # (the second 7 repeats position 0); sample 1 pos 0 (target 3): {} (3 is the target); pos 1 (target 8): {3}
    assert kept == [[True, False, False, False], [False, True, False, False], [True, True, False, False],
                    [False, False, False, False], [True, False, False, False]]
    normed = torch.nn.functional.normalize(items, dim=-1)
    assert torch.allclose(got[2, :2], query[2] @ normed[:2].t() / 0.5)
    assert torch.allclose(got[4, 0], query[4] @ normed[4] / 0.5)


@pytest.mark.parametrize("name", ["hstu", "sasrec"])
def test_history_negatives_push_the_read_items_down(name):
    """One gradient step with history negatives lowers the query's score of its prefix items more than one without
    (negative control: with the option off the prefix items get only the uniform negatives' push)."""
    from nestpipe.trainer.models.common import next_item_loss

    lengths = torch.tensor([6])
    ids = torch.tensor([11, 12, 13, 14, 15, 16])
    emb = _emb([6], 5)
    negs = torch.randn(8, D, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    feats = {"lengths": lengths, "item_ids": ids, "neg_ids": torch.arange(100, 108)}
    drops = []
    for on in (False, True):
        m = _model(name)
        e = {k: v.clone().requires_grad_(k == "item") for k, v in emb.items()}
        e["item#neg"] = negs
        loss = next_item_loss(m.encode(e, lengths), e, feats, 0.1, history_negatives=on).sum()
        loss.backward()
        hidden = m.encode(e, lengths)[4].detach()  # query at position 4: prefix items 11..15, target 16
        before = torch.nn.functional.normalize(e["item"][:4].detach(), dim=-1) @ torch.nn.functional.normalize(hidden, dim=-1)
        after_items = e["item"][:4].detach() - 0.5 * e["item"].grad[:4]
        after = torch.nn.functional.normalize(after_items, dim=-1) @ torch.nn.functional.normalize(hidden, dim=-1)
        drops.append(float((before - after).sum()))
    assert drops[1] > drops[0], drops


@pytest.mark.parametrize("name", ["hstu", "sasrec"])
def test_untied_item_rows_are_input_then_output_halves(name):
    """``output_embedding="untied"``: an item row is ``[input | output]``; the tokens read only the input half, the
    objective's candidates (target, shared negatives, history negatives) only the output half. Negative control:
    the tied model on the same rows' first half sees a change to the input half in its candidates."""
    lengths = torch.tensor([5, 4])
    g = torch.Generator().manual_seed(7)
    n = int(lengths.sum())
    feats = {"lengths": lengths, "item_ids": torch.arange(20, 20 + n), "neg_ids": torch.arange(100, 108)}

    def rows(k):
        return torch.randn(k, 2 * D, generator=g, dtype=torch.float64)

    emb = {"item": rows(n), "action": torch.randn(n, D, generator=g, dtype=torch.float64), "item#neg": rows(8)}
    m = _model(name)
    assert m.untied and m.cfg.output_embedding == "untied"
    loss = m(emb, feats)
    # the hidden states are those of the input halves alone
    torch.testing.assert_close(m.encode(m.token_inputs(emb), lengths),
                               m.encode({"item": emb["item"][:, :D], "action": emb["action"]}, lengths))
    # a changed output half of the negatives changes the loss; a changed input half of the negatives does not
    out_changed = {**emb, "item#neg": emb["item#neg"].clone()}
    out_changed["item#neg"][:, D:] += 1.0
    assert not torch.allclose(m(out_changed, feats), loss)
    in_changed = {**emb, "item#neg": emb["item#neg"].clone()}
    in_changed["item#neg"][:, :D] += 1.0
    torch.testing.assert_close(m(in_changed, feats), loss, rtol=0, atol=0)
    # negative control: tied, the negatives' (only) half is what the candidates read
    tied = _model(name)
    tied.untied = False
    half = {k: (v[:, :D] if k != "action" else v) for k, v in emb.items()}
    half_changed = {k: (v[:, :D] if k != "action" else v) for k, v in in_changed.items()}
    assert not torch.allclose(tied(half_changed, feats), tied(half, feats))


def _composed_lse(q, negs, w, targets, neg_ids):
    """The shared negatives' logsumexp from composed ops (the definition)."""
    scores = (q @ negs.t() + w).masked_fill(targets[:, None] == neg_ids[None, :], float("-inf"))
    return torch.logsumexp(scores, dim=1)


@pytest.mark.parametrize("log_weight", [0.0, 3.7])
def test_shared_negatives_lse_is_the_composed_logsumexp(log_weight):
    """:class:`SharedNegativesLSE` (one buffer, exponentiated in place) gives the composed ops' values and
    gradients, with the negatives equal to a query's target left out of that query's row (repeated negative ids
    included) and a row whose every negative collides giving -inf, not nan. Negative control: without the collision
    pairs the values differ exactly in the rows that have one."""
    from nestpipe.trainer.models.common import SharedNegativesLSE, _collisions

    g = torch.Generator().manual_seed(3)
    Q, K = 40, 25
    q = torch.randn(Q, D, dtype=torch.float64, generator=g, requires_grad=True)
    negs = torch.randn(K, D, dtype=torch.float64, generator=g, requires_grad=True)
    neg_ids = torch.randint(0, 12, (K,), generator=g)
    targets = torch.randint(0, 30, (Q,), generator=g)
    rows, cols = _collisions(targets, neg_ids)
    assert sorted(zip(rows.tolist(), cols.tolist())) == sorted(
        (i, j) for i in range(Q) for j in range(K) if targets[i] == neg_ids[j])
    got = SharedNegativesLSE.apply(q, negs, log_weight, rows, cols)
    want = _composed_lse(q, negs, log_weight, targets, neg_ids)
    torch.testing.assert_close(got, want)
    upstream = torch.randn(Q, dtype=torch.float64, generator=g)
    grads = torch.autograd.grad((got * upstream).sum(), (q, negs))
    wants = torch.autograd.grad((want * upstream).sum(), (q, negs))
    for a, b in zip(grads, wants):
        torch.testing.assert_close(a, b)
    r6, c6 = _collisions(targets[:6], neg_ids)
    assert torch.autograd.gradcheck(lambda a, b: SharedNegativesLSE.apply(a, b, log_weight, r6, c6),
                                    (q.detach()[:6].requires_grad_(), negs.detach().requires_grad_()))
    # negative control: leaving the collisions in changes exactly the rows that have one
    empty = torch.zeros(0, dtype=torch.long)
    loose = SharedNegativesLSE.apply(q, negs, log_weight, empty, empty)
    hit = torch.zeros(Q, dtype=torch.bool)
    hit[rows] = True
    assert hit.any() and (~hit).any()
    assert not torch.allclose(loose[hit], got[hit]) and torch.equal(loose[~hit], got[~hit])
    # every negative of a row masked: -inf (the target's own logit carries that row's softmax)
    one = torch.tensor([5])
    r, c = _collisions(one, torch.full((4,), 5))
    empty_row = SharedNegativesLSE.apply(q[:1], negs[:4], log_weight, r, c)
    assert torch.isneginf(empty_row).all()
    loss = torch.logsumexp(torch.stack([q[0, 0], empty_row[0]]), 0)  # the row's softmax of the target alone
    gq, gn = torch.autograd.grad(loss, (q, negs))
    assert torch.isfinite(gq).all() and torch.isfinite(gn).all() and float(gn.abs().sum()) == 0.0


def test_dlrm_dot_pairs_add_the_embeddings_dot_product_to_the_logit():
    from nestpipe.trainer.models.dlrm import DLRM, DLRMConfig

    torch.manual_seed(0)
    dims = {"last_video": 8, "video_id": 8, "user_id": 8}
    emb = {t: torch.randn(5, 8) for t in dims}
    dense = torch.randn(5, 3)
    plain = DLRM(DLRMConfig(dot_pairs=()), 3, dims)
    paired = DLRM(DLRMConfig(dot_pairs=("last_video*video_id", "absent*video_id")), 3, dims)
    paired.load_state_dict(plain.state_dict())  # the pair term has no parameters of its own
    assert paired.dot_pairs == [("last_video", "video_id")]  # pairs of tables the shards lack are skipped
    want = plain.logits(emb, dense) + (emb["last_video"] * emb["video_id"]).sum(1)
    assert torch.allclose(paired.logits(emb, dense), want, atol=1e-6)
    # negative control: the term is really there (and reaches the embeddings' gradients)
    assert not torch.allclose(paired.logits(emb, dense), plain.logits(emb, dense), atol=1e-3)
    e = {t: v.clone().requires_grad_() for t, v in emb.items()}
    paired.logits(e, dense).sum().backward()
    assert torch.allclose(e["last_video"].grad - _grad_without_pair(plain, emb, dense), emb["video_id"], atol=1e-6)
    with pytest.raises(ValueError, match="expected 'table_a\\*table_b'"):
        DLRM(DLRMConfig(dot_pairs=("last_video",)), 3, dims)
    with pytest.raises(ValueError, match="widths 8 and 4 differ"):
        DLRM(DLRMConfig(dot_pairs=("last_video*video_id",)), 3, {**dims, "video_id": 4})


def _grad_without_pair(model, emb, dense):
    e = {t: v.clone().requires_grad_() for t, v in emb.items()}
    model.logits(e, dense).sum().backward()
    return e["last_video"].grad


@pytest.mark.parametrize("lens", [[4, 3], [1, 5, 1, 2], [6, 6, 6], [2, 2, 31, 3, 2], [9]])
def test_bucketed_history_lse_is_the_logsumexp_of_the_padded_history_logits(lens):
    """The objective's history term, computed per length bucket, equals the padded definition's logsumexp (values
    and gradients, float64), on length mixes with repeated items (a length-1 sample has no query)."""
    from nestpipe.trainer.models.common import _history_logits, _history_lse

    torch.manual_seed(1)
    lengths = torch.tensor(lens)
    T = int(lengths.sum())
    item_ids = torch.randint(0, 6, (T,))  # few distinct ids: repeats and target hits everywhere
    items = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    ends = torch.cumsum(lengths, 0) - 1
    is_q = torch.ones(T, dtype=torch.bool)
    is_q[ends] = False
    q_idx = torch.nonzero(is_q).flatten()
    query = torch.randn(len(q_idx), D, dtype=torch.float64, requires_grad=True)
    want = _history_logits(query, items, item_ids, lengths, q_idx, 0.3).logsumexp(-1)
    got = _history_lse(query, items, item_ids, lengths, q_idx, 0.3)
    # where nothing is kept both are about -1e9 (the term vanishes from the softmax); elsewhere equal
    real = want > -1e8
    assert torch.equal(real, got > -1e8) and bool((got[~real] < -1e8).all())
    assert torch.allclose(got[real], want[real], rtol=0, atol=1e-12)
    w = torch.randn(int(real.sum()), dtype=torch.float64)
    ga = torch.autograd.grad((got[real] * w).sum(), (query, items))
    gb = torch.autograd.grad((want[real] * w).sum(), (query, items))
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(ga, gb))
    # negative control: the same items in reversed order within each sample (other prefixes) change the values,
    # so the comparison sees which positions a query reads
    flip = torch.cat([torch.arange(int(a), int(b)).flip(0) for a, b in zip(ends + 1 - lengths, ends + 1)])
    other = _history_logits(query, items[flip], item_ids[flip], lengths, q_idx, 0.3).logsumexp(-1)
    assert not torch.allclose(other, want)


def test_in_batch_negatives_count_every_distinct_item_once():
    """With every target row taken (limit >= Q), the logQ-corrected in-batch term of a query is the logsumexp over
    the DISTINCT target items other than its own: item j's c_j copies, each corrected by -log(c_j), weigh one item.
    Negative control: without the correction (weights 0) the copies count c_j times and the values differ. Gradients
    match the composed reference; a limit below Q takes evenly spaced positions."""
    from nestpipe.trainer.models.common import SharedNegativesLSE, _collisions, _in_batch_lse

    g = torch.Generator().manual_seed(5)
    Q = 30
    ids = torch.randint(0, 7, (Q,), generator=g)  # many repeats
    table = torch.randn(7, D, dtype=torch.float64, generator=g)
    targets = table[ids].clone().requires_grad_(True)  # a repeated item has the same row (one embedding row)
    q = torch.randn(Q, D, dtype=torch.float64, generator=g, requires_grad=True)
    got = _in_batch_lse(q, targets, ids, limit=1000)
    uniq = torch.unique(ids)
    want = torch.stack([torch.logsumexp(torch.stack([q[i] @ targets[int(torch.nonzero(ids == j)[0])]
                                                     for j in uniq if j != ids[i]]), 0) for i in range(Q)])
    torch.testing.assert_close(got, want)
    up = torch.randn(Q, dtype=torch.float64, generator=g)
    gq, gt = torch.autograd.grad((got * up).sum(), (q, targets))
    wq, wt = torch.autograd.grad((want * up).sum(), (q, targets))
    torch.testing.assert_close(gq, wq)
    # per item, the gradient of its copies sums to that of the one row the reference used
    for j in uniq:
        torch.testing.assert_close(gt[ids == j].sum(0), wt[ids == j].sum(0))
    # negative control: the same negatives without the logQ weights count each item c_j times
    rows, cols = _collisions(ids, ids)
    raw = SharedNegativesLSE.apply(q, targets, 0.0, rows, cols)
    assert not torch.allclose(raw, got)
    # a limit below Q: N evenly spaced positions, the first included
    part = _in_batch_lse(q, targets, ids, limit=4)
    pick = torch.tensor([0, 7, 15, 22])
    counts = torch.stack([(ids == ids[p]).sum() for p in pick]).to(torch.float64)
    r4, c4 = _collisions(ids, ids[pick])
    torch.testing.assert_close(part, SharedNegativesLSE.apply(q, targets[pick], -torch.log(counts * 4 / Q), r4, c4))


def test_bfloat16_negative_logits_stay_close_to_float32():
    from nestpipe.trainer.models.common import SharedNegativesLSE, _collisions

    g = torch.Generator().manual_seed(7)
    q = torch.nn.functional.normalize(torch.randn(64, D, generator=g), dim=-1).requires_grad_(True)
    negs = torch.nn.functional.normalize(torch.randn(50, D, generator=g), dim=-1).requires_grad_(True)
    r, c = _collisions(torch.arange(64), torch.arange(50))
    full = SharedNegativesLSE.apply(q / 0.1, negs, 2.0, r, c)
    low = SharedNegativesLSE.apply(q / 0.1, negs, 2.0, r, c, torch.bfloat16)
    assert low.dtype == torch.float32 and not torch.equal(low, full)  # computed differently ...
    torch.testing.assert_close(low, full, rtol=0, atol=0.05)  # ... within bfloat16's 8 mantissa bits
    ga = torch.autograd.grad(full.sum(), (q, negs))
    gb = torch.autograd.grad(low.sum(), (q, negs))
    for a, b in zip(ga, gb):
        assert b.dtype == torch.float32
        torch.testing.assert_close(b, a, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("name", ["hstu", "sasrec"])
def test_transition_term_adds_the_last_items_from_to_cosine(name):
    """``transition = w``: item rows ``[input | output | from | to]``; a position's score of candidate ``c`` is
    ``(cos(hidden, output_c) + w cos(from_own_item, to_c)) / temperature``. Checked against that formula
    written out (no history or in-batch negatives, no logQ). Negative controls: the same formula reading the
    target's ``from`` block (one position late), or without the term, gives another loss."""
    w, temp = 0.7, 0.1
    m = _model(name)
    m.cfg = type(m.cfg)(**{**m.cfg.__dict__, "transition": w, "history_negatives": False, "in_batch_negatives": 0,
                           "logq_correction": False, "temperature": temp})
    m.transition = w
    lengths = torch.tensor([5, 3])
    n = int(lengths.sum())
    g = torch.Generator().manual_seed(11)
    emb = {"item": torch.randn(n, 4 * D, generator=g, dtype=torch.float64),
           "action": torch.randn(n, D, generator=g, dtype=torch.float64),
           "item#neg": torch.randn(6, 4 * D, generator=g, dtype=torch.float64)}
    feats = {"lengths": lengths, "item_ids": torch.arange(20, 20 + n), "neg_ids": torch.arange(100, 106)}
    loss = m(emb, feats)
    unit = lambda x: torch.nn.functional.normalize(x, dim=-1)
    hidden = m.encode({"item": emb["item"][:, :D], "action": emb["action"]}, lengths)

    def reference(from_shift=0, weight=w):
        out = []
        start = 0
        for length in lengths.tolist():
            per = []
            for p in range(start, start + length - 1):
                cands = torch.cat([emb["item"][p + 1:p + 2], emb["item#neg"]])
                score = unit(hidden[p]) @ unit(cands[:, D:2 * D]).t()
                score = score + weight * unit(emb["item"][p + from_shift, 2 * D:3 * D]) @ unit(cands[:, 3 * D:]).t()
                score = score / temp
                per.append(torch.logsumexp(score, 0) - score[0])
            out.append(torch.stack(per).mean())
            start += length
        return torch.stack(out)

    torch.testing.assert_close(loss, reference())
    assert not torch.allclose(loss, reference(from_shift=1))
    assert not torch.allclose(loss, reference(weight=0.0))
    # the rows are four blocks wide, and the tokens read only the input block
    from nestpipe.trainer.models.common import sequential_table_widths
    assert sequential_table_widths(m.cfg) == {"item": 4}
    changed = {**emb, "item": emb["item"].clone()}
    changed["item"][:, 2 * D:] += 1.0
    torch.testing.assert_close(m.encode(m.token_inputs(changed), lengths), hidden, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["hstu", "sasrec"])
def test_item_bias_adds_each_candidates_offset_to_every_logit(name):
    """``item_bias = s``: item rows ``[input | output | bias columns]``; every logit of candidate ``c`` (the target,
    the shared negatives, the in-batch and the history negatives) is ``cos(hidden, output_c) / temperature + s a_c``
    (``a_c`` the first bias column), beside the logQ terms. Checked against that written out; negative controls:
    the offsets on the target alone, or none, give other losses. The candidate side's gradients (every copy of an
    item summed into its row) are the written-out loss's; they reach the first bias column only, and the tokens never read the bias
    columns."""
    from nestpipe.trainer.models.common import ITEM_BIAS_COLUMNS, sequential_table_widths

    s, temp, V, K = 0.8, 0.1, 1000, 6
    m = _model(name)
    m.cfg = type(m.cfg)(**{**m.cfg.__dict__, "item_bias": s, "history_negatives": True, "in_batch_negatives": 1000,
                           "logq_correction": True, "temperature": temp, "num_random_negatives": K})
    m.item_bias, m.num_items = s, V
    assert sequential_table_widths(m.cfg) == {"item": (2, ITEM_BIAS_COLUMNS)}
    width = 2 * D + ITEM_BIAS_COLUMNS
    g = torch.Generator().manual_seed(12)
    table = torch.randn(20, width, generator=g, dtype=torch.float64)
    table[:, 2 * D] = torch.randn(20, generator=g, dtype=torch.float64) * 2  # offsets of a few logits
    table.requires_grad_(True)
    lengths = torch.tensor([5, 4])
    ids = torch.tensor([3, 7, 3, 9, 7, 4, 9, 4, 7])  # repeats: history and in-batch negatives dedupe by id
    neg_ids = torch.tensor([11, 9, 12, 13, 14, 15])  # 9 is a target of some positions (masked there)
    item = table[ids]
    emb = {"item": item, "action": torch.randn(len(ids), D, generator=g, dtype=torch.float64),
           "item#neg": table[neg_ids]}
    feats = {"lengths": lengths, "item_ids": ids, "neg_ids": neg_ids}
    loss = m(emb, feats)
    hidden = m.encode(m.token_inputs(emb), lengths).detach()
    unit = lambda x: torch.nn.functional.normalize(x, dim=-1)
    w = math.log(V / K)
    starts = [0, 5]
    q_tok = [p for st, n in zip(starts, lengths.tolist()) for p in range(st, st + n - 1)]

    def reference(offsets=True, negatives_too=True):
        def logit(p, item_id, extra=0.0, is_target=False):
            row = table[item_id]
            b = s * row[2 * D] if offsets and (is_target or negatives_too) else 0.0
            return unit(hidden[p]) @ unit(row[D:2 * D]) / temp + b + extra

        out = []
        for st, n in zip(starts, lengths.tolist()):
            per = []
            for p in range(st, st + n - 1):
                t = int(ids[p + 1])
                ls = [logit(p, t, is_target=True)]
                ls += [logit(p, int(j), w) for j in neg_ids if int(j) != t]
                ls += [logit(p, j) for j in sorted({int(ids[q + 1]) for q in q_tok}) if j != t]
                ls += [logit(p, j) for j in sorted({int(x) for x in ids[st:p + 1]}) if j != t]
                ls = torch.stack([torch.as_tensor(x, dtype=torch.float64) for x in ls])
                per.append(torch.logsumexp(ls, 0) - ls[0])
            out.append(torch.stack(per).mean())
        return torch.stack(out)

    torch.testing.assert_close(loss.detach(), reference())
    assert not torch.allclose(loss.detach(), reference(negatives_too=False))
    assert not torch.allclose(loss.detach(), reference(offsets=False))
    (got,) = torch.autograd.grad(loss.sum(), table)
    (want,) = torch.autograd.grad(reference().sum(), table)
    torch.testing.assert_close(got[:, D:], want[:, D:])  # the candidate side (the reference's queries are fixed)
    assert got[:, 2 * D].abs().sum() > 0 and got[:, 2 * D + 1:].abs().sum() == 0
    changed = {**emb, "item": item.detach().clone()}
    changed["item"][:, 2 * D:] += 1.0
    torch.testing.assert_close(m.encode(m.token_inputs(changed), lengths), hidden, rtol=0, atol=0)
