"""The one view of running rows (core/rows.py): the steady-decode plan, the general plan and
applying a result read the same view; its fields are its Requests'; a field is declared once."""

from __future__ import annotations

import time

import numpy as np

from gapless.common.messages import AddRequest, SamplingParams
from gapless.core.apply import check_stop
from gapless.core.rows import FIELDS, Rows
from tests.core.test_scheduler import EOS, fake_result, make_requests, make_scheduler


def _add(s, rid: str, prompt_len: int = 6, tenant: str = "", priority: int = 0, **params):
    params.setdefault("max_tokens", 8)
    prompt = [100 + len(s.requests)] + list(range(11, 10 + prompt_len))
    msg = AddRequest(rid, 0, prompt, SamplingParams(**params), time.time(), tenant, priority)
    return s.add_request(msg)


def _varied(s) -> list:
    return [
        _add(s, "a", max_tokens=5, min_tokens=2, tenant="t1"),
        _add(s, "b", prompt_len=9, ignore_eos=True, stop_token_ids=[55], priority=3),
        _add(s, "c", prompt_len=3, max_tokens=200, tenant="t2", priority=-1),
    ]


def test_the_decode_plan_the_general_plan_and_apply_share_one_view():
    s = make_scheduler(num_blocks=12, block_size=4)  # 11 usable blocks
    make_requests(s, 2, max_tokens=20)
    step = s.schedule()
    s.update_from_output(step, fake_result(step))
    view = s.rb.rows()
    step = s.schedule()
    assert step.decode is view and step.rows is view, "the decode plan samples every row"
    out = s.update_from_output(step, fake_result(step))
    assert out.request_ids is view.request_ids
    assert s.rb.rows() is view, "kept while the set holds"
    _add(s, "long", prompt_len=40)  # 10 blocks: it waits, so a seat is free and unfilled
    step = s.schedule()
    assert step.decode is None and step.rows is view, "the general plan, the same view"
    s.update_from_output(step, fake_result(step, EOS))  # both end: the set changes
    assert s.rb.rows() is not view


def test_a_views_fields_are_its_requests():
    s = make_scheduler()
    reqs = _varied(s)
    step = s.schedule()
    view = s.rb.rows()
    assert view.requests == reqs and view.slot_list == [r.slot for r in reqs]
    assert view.prompt_len.tolist() == [r.num_prompt for r in reqs] == view.num_prompt_tokens
    assert view.limit.tolist() == [r.limit for r in reqs] == [11, 17, 128]  # c: the context
    assert view.min_len.tolist() == [8, 9, 3]
    assert view.ignore_eos.tolist() == [False, True, False]
    assert view.has_stop_ids.tolist() == [False, True, False] and view.any_stop_ids
    assert view.tenant_id.tolist() == [r.tenant_id for r in reqs] == [0, 1, 2]
    assert view.priority.tolist() == [0, 3, -1]
    assert view.tenant_counts(4).tolist() == [1, 1, 1, 0]
    off = Rows.off_slot(reqs)
    for name, (dtype, _) in FIELDS.items():
        column = getattr(view, name)
        assert column.dtype == dtype and getattr(off, name).tolist() == column.tolist(), name
    part = view.take(np.asarray([2, 0]))
    assert part.requests == [reqs[2], reqs[0]] and part.limit.tolist() == [128, 11]
    assert part.slots.tolist() == [reqs[2].slot, reqs[0].slot]
    assert step.rows.request_ids == ["a", "b", "c"]


def test_check_stop_reads_a_view_on_and_off_slots_alike():
    s = make_scheduler()
    reqs = _varied(s)
    step = s.schedule()
    s.update_from_output(step, fake_result(step))
    view = s.rb.rows()
    num_out = np.asarray([len(r.output_ids) + 1 for r in reqs], np.int64)
    eos = np.asarray([EOS], np.int64)
    for tokens in ([EOS, EOS, EOS], [55, 55, 55], [7, 7, 7]):
        t = np.asarray(tokens, np.int64)
        on_reasons, on_ended = check_stop(view, t, num_out, eos)
        off_reasons, off_ended = check_stop(Rows.off_slot(reqs), t, num_out, eos)
        assert on_reasons == off_reasons and on_ended.tolist() == off_ended.tolist()
    # a: EOS within min_tokens; b: ignores EOS, stops on 55; c: goes on
    assert check_stop(view, np.asarray([EOS, 55, 7]), num_out, eos)[0] == ["", "stop_token", ""]


def test_a_field_declared_once_reaches_admit_the_gather_and_the_off_slot_view(monkeypatch):
    monkeypatch.setitem(FIELDS, "max_tokens", (np.int64, lambda r: r.params.max_tokens))
    s = make_scheduler()
    reqs = _varied(s)
    step = s.schedule()
    assert s.rb.columns["max_tokens"][[r.slot for r in reqs]].tolist() == [5, 8, 200]
    assert step.rows.max_tokens.tolist() == [5, 8, 200]
    assert s.rb.rows().take(np.asarray([1])).max_tokens.tolist() == [8]
    assert Rows.off_slot(reqs).max_tokens.tolist() == [5, 8, 200]
