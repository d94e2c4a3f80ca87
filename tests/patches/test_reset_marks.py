"""The ``reset-prefix-cache-in-flight`` wrappers on both forms of the release's discard mark, one request at a time
(the streams and counters over whole workloads: tests/parity/test_reset_prefix_cache_streams.py on 0.13 - 0.25).

The release's ``reset_prefix_cache`` body is mirrored per form, for the lines the wrapper depends on: it preempts every
running request (``running`` emptied) and marks it, up to vLLM 0.21 with ``discard_latest_async_tokens = True``
(0.18.0 ``scheduler.py:1853-1859``, 0.19.0 ``:1887``), from 0.22 with ``async_tokens_to_discard =
num_output_placeholders`` (0.23.0 ``:1970``), zeroing the placeholders; ``reset_running_requests=False`` preempts
nothing. Requests and scheduler are plain records with the attributes the wrappers read (``Request``: the form's mark,
``vllm/v1/request.py``; ``Scheduler``: ``running``, ``requests``, ``parallel_config``)."""

from __future__ import annotations

import types

import pytest

from zb_patch.versions.fixes.reset_prefix_cache_in_flight import make_reset_prefix_cache, make_update_from_output

FLAG, COUNT = "flag", "count"


def _request(form: str, rid: str, placeholders: int):
    r = types.SimpleNamespace(request_id=rid, num_output_placeholders=placeholders)
    if form == FLAG:
        r.discard_latest_async_tokens = False
    else:
        r.async_tokens_to_discard = 0
    return r


def _release_reset(form: str):
    def reset_prefix_cache(scheduler, reset_running_requests=False, reset_connector=False):
        while reset_running_requests and scheduler.running:
            request = scheduler.running.pop()
            if form == FLAG:
                request.discard_latest_async_tokens = True
            else:
                request.async_tokens_to_discard = request.num_output_placeholders
            request.num_output_placeholders = 0
        return "result"

    return reset_prefix_cache


def _scheduler(requests, pp=1):
    return types.SimpleNamespace(
        running=list(requests),
        requests={r.request_id: r for r in requests},
        parallel_config=types.SimpleNamespace(pipeline_parallel_size=pp),
    )


def _mark(form, r):
    return r.discard_latest_async_tokens if form == FLAG else r.async_tokens_to_discard


@pytest.mark.parametrize("form", [FLAG, COUNT])
@pytest.mark.parametrize("by_keyword", [False, True])
def test_each_preempted_request_is_marked_for_exactly_its_output_in_flight(form, by_keyword):
    idle, one, drafts = _request(form, "idle", 0), _request(form, "one", 1), _request(form, "drafts", 4)
    sched = _scheduler([idle, one, drafts])
    reset = make_reset_prefix_cache(_release_reset(form))
    result = reset(sched, reset_running_requests=True) if by_keyword else reset(sched, True)
    assert result == "result" and sched.running == []
    expected = {FLAG: (False, True, True), COUNT: (0, 1, 1)}[form]
    assert tuple(_mark(form, r) for r in (idle, one, drafts)) == expected


@pytest.mark.parametrize("form", [FLAG, COUNT])
def test_a_reset_that_preempts_nothing_leaves_the_marks(form):
    """reset_running_requests=False: the running requests keep whatever mark they had (the release sets none)."""
    kept = _request(form, "kept", 0)
    if form == FLAG:
        kept.discard_latest_async_tokens = True
    else:
        kept.async_tokens_to_discard = 2
    sched = _scheduler([kept])
    make_reset_prefix_cache(_release_reset(form))(sched, False)
    assert sched.running == [kept] and _mark(form, kept) == {FLAG: True, COUNT: 2}[form]


def test_with_pipeline_stages_the_release_count_is_kept():
    """PP > 1: several outputs can be in flight per request; the count is left as the release sets it."""
    drafts = _request(COUNT, "drafts", 4)
    sched = _scheduler([drafts], pp=2)
    make_reset_prefix_cache(_release_reset(COUNT))(sched, True)
    assert drafts.async_tokens_to_discard == 4


@pytest.mark.parametrize("form", [FLAG, COUNT])
@pytest.mark.parametrize("by_keyword", [False, True])
def test_the_loop_gets_no_drafts_of_a_marked_request(form, by_keyword):
    marked, live = _request(form, "marked", 0), _request(form, "live", 4)
    if form == FLAG:
        marked.discard_latest_async_tokens = True
    else:
        marked.async_tokens_to_discard = 1
    sched = _scheduler([live])
    sched.requests["marked"] = marked
    drafts = {"marked": [5, 6], "live": [7, 8], "gone": [9]}  # "gone": finished, no longer held
    output = types.SimpleNamespace(scheduled_spec_decode_tokens=drafts, other="kept")
    seen = []

    def loop(scheduler, scheduler_output, model_runner_output, extra=None):
        seen.append((scheduler_output, model_runner_output, extra))
        return "outputs"

    update = make_update_from_output(loop)
    got = update(sched, output, "mro", extra=3) if by_keyword else update(sched, output, "mro", 3)
    assert got == "outputs" and output.scheduled_spec_decode_tokens is drafts  # the runner's output unchanged
    ((copy, mro, extra),) = seen
    assert copy is not output and copy.other == "kept" and (mro, extra) == ("mro", 3)
    assert copy.scheduled_spec_decode_tokens == {"live": [7, 8], "gone": [9]}


def test_the_loop_gets_the_output_itself_when_nothing_is_marked():
    sched = _scheduler([_request(COUNT, "live", 4)])
    output = types.SimpleNamespace(scheduled_spec_decode_tokens={"live": [7]})
    seen = []
    make_update_from_output(lambda s, o, m: seen.append(o))(sched, output, None)
    assert seen == [output] and seen[0] is output
