"""The one host core (engine/core.py) that the offline runner and the serving engine both
drive: its events, pipelined or not, its page accounting, and ends by the driver."""

import chex
import pytest

from dspark_jax.decode.autoregressive import generate as ar_generate
from dspark_jax.decode.step import FINISH_NONE, SpeculativeDecoder, StepConfig, request_key_data
from dspark_jax.engine.core import CoreRequest, Emitted, EngineCore, RoundDone
from tests.decode.test_decode_step import PROMPTS, V, _drafter
from tests.decode.test_decode_step import target as target  # noqa: F401 (the module fixture)

MAX_LEN = 48


def _decoder(target, slots=3, pages=None):  # noqa: F811
    model, params = target
    drafter, dparams = _drafter("dspark")
    cfg = StepConfig(
        num_slots=slots, max_len=MAX_LEN, scheduler="fixed",
        **({} if pages is None else {"page_size": 4, "num_pages": pages}),
    )  # fmt: skip
    return SpeculativeDecoder(model, params, drafter, dparams, cfg)


def _requests(n, max_new=8):
    return [
        CoreRequest(PROMPTS[i % len(PROMPTS)] + [i % V], max_new - i % 3, 0.0, 0, 1.0,
                    request_key_data(0, i), tag=i)
        for i in range(n)
    ]  # fmt: skip


def _run(core, requests, end_after=None):
    """Drive ``core`` to the end: tokens per tag, events seen; ``end_after`` = (tag, n):
    the driver ends that request once it holds n tokens."""
    core.reset()
    for r in requests:
        core.add(r)
    tokens = {r.tag: [] for r in requests}
    finished, rounds = {}, []
    while core.has_work:
        for ev in core.step():
            if isinstance(ev, RoundDone):
                rounds.append(ev)
                continue
            assert isinstance(ev, Emitted) and ev.request.tag not in finished, ev
            tokens[ev.request.tag] += ev.tokens
            if ev.round_index is not None:
                assert 0 <= ev.accepted <= ev.verified <= 4
                chex.assert_shape((ev.survival, ev.draft_tokens), (4,))
            if ev.finish != FINISH_NONE:
                finished[ev.request.tag] = ev.finish
            elif end_after and ev.request.tag == end_after[0]:
                if len(tokens[ev.request.tag]) >= end_after[1]:
                    core.end(ev.request)
                    finished[ev.request.tag] = "ended"
    return tokens, finished, rounds


@pytest.mark.parametrize("pipelined", [False, True])
def test_core_events_give_autoregressive_greedy_tokens(target, pipelined):  # noqa: F811
    model, params = target
    core = EngineCore(_decoder(target), pipelined=pipelined, prefill_batch=2)
    requests = _requests(7)
    tokens, finished, rounds = _run(core, requests)
    for r in requests:
        ref = ar_generate(model, params, [list(r.prompt)], r.max_new_tokens, max_len=MAX_LEN)
        assert tokens[r.tag] == ref.tokens[0], r.tag
    assert set(finished) == {r.tag for r in requests}
    assert core.pages.used == 0 and core.active_slots == 0 and not core.inflight
    assert [ev.index for ev in rounds] == list(range(len(rounds)))
    assert all(ev.budget in core.policy.buckets for ev in rounds)


def test_an_ended_request_frees_its_slot_and_pages_and_gets_no_more_events(target):  # noqa: F811
    """The driver ends request 1 after 3 tokens (a stop string): no event for it follows,
    even from the round already in flight (pipelined), and the others are unaffected."""
    model, params = target
    core = EngineCore(_decoder(target, pages=20), pipelined=True)
    requests = _requests(5, max_new=10)
    tokens, finished, _ = _run(core, requests, end_after=(1, 3))
    assert finished[1] == "ended" and 3 <= len(tokens[1]) < requests[1].max_new_tokens
    for r in requests:
        if r.tag == 1:
            continue
        ref = ar_generate(model, params, [list(r.prompt)], r.max_new_tokens, max_len=MAX_LEN)
        assert tokens[r.tag] == ref.tokens[0]
    assert core.pages.used == 0 and core.pages.free == core.pages.capacity


def test_requests_wait_for_pages_and_none_is_lost(target):  # noqa: F811
    """A pool of 9 pages for 3 slots: requests queue for pages (counted), all finish."""
    core = EngineCore(_decoder(target, pages=9))
    requests = _requests(6, max_new=10)
    tokens, finished, _ = _run(core, requests)
    assert set(finished) == {r.tag for r in requests}
    assert all(len(tokens[r.tag]) == r.max_new_tokens for r in requests)
    assert core.times.page_waits > 0


def test_a_request_ending_at_its_first_token_frees_its_slot_in_the_same_turn(target):  # noqa: F811
    """Offline (not pipelined): a request with max_new_tokens = 1 ends at prefill, and the
    next waiting request takes its slot before the round is dispatched."""
    core = EngineCore(_decoder(target, slots=1))
    one, two = _requests(2)
    one.max_new_tokens = 1
    core.reset()
    core.add(one)
    core.add(two)
    events = core.step()
    kinds = [(e.request.tag, e.round_index) for e in events if isinstance(e, Emitted)]
    assert kinds[:2] == [(0, None), (1, None)] and kinds[2] == (1, 0), kinds
    assert one.done and core.slots[0] is two


def test_requests_the_core_could_never_hold_are_refused_by_name(target):  # noqa: F811
    core = EngineCore(_decoder(target, pages=9))
    with pytest.raises(ValueError, match="empty prompt"):
        core.add(CoreRequest([], 4, 0.0, 0, 1.0, request_key_data(0)))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        core.add(CoreRequest([1, 2], 0, 0.0, 0, 1.0, request_key_data(0)))
    with pytest.raises(ValueError, match=r"prompt has 47 tokens but the cache holds 48"):
        core.add(CoreRequest([1] * 47, 1, 0.0, 0, 1.0, request_key_data(0)))
    with pytest.raises(ValueError, match=r"needs 10 KV pages"):
        core.add(CoreRequest([1] * 30, 6, 0.0, 0, 1.0, request_key_data(0)))
    assert not core.waiting
