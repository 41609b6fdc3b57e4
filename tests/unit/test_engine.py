"""The engine: same tokens and logprobs as the reference decoder, batching that changes nothing,
sampling controls that do what they say, hot swaps that freeze rather than drop, and clear errors."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import numpy as np
import pytest
import torch

from realtime_rl.engine import AsyncEngine, Engine, EngineOverloaded, EngineStopped, SamplingParams
from realtime_rl.model import Qwen3ForCausalLM, generate
from tests.conftest import tiny_config

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture
def moe():
    model = Qwen3ForCausalLM(tiny_config(moe=True))
    model.reset_parameters(seed=0)
    return model.eval()


def prompts(*lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


def test_batched_greedy_matches_the_reference_decoder_token_for_token(moe):
    ps = prompts(5, 11, 3, 8)
    outs = Engine(moe, max_batch=8, max_seq_len=64).generate(ps, GREEDY)
    for p, out in zip(ps, outs):
        ref = generate(moe, p, 10, temperature=0.0)
        s = out.samples[0]
        assert s.token_ids == ref.token_ids
        torch.testing.assert_close(torch.tensor(s.raw_logprobs), torch.tensor(ref.raw_logprobs), atol=1e-5, rtol=0)
        assert (s.routing == ref.routing_TLK.numpy()).all()
        assert s.routing.shape == (len(p) + len(s.token_ids) - 1, 3, 2)
        assert s.logprobs == [0.0] * 10 and s.finish_reason == "length"


@pytest.mark.parametrize("way", ["view", "rows", "gather"])
def test_rows_in_scattered_slots_decode_exactly(moe, monkeypatch, way):
    """Short requests retire first and leave free slots between the long ones: the decode batch then reads
    its prefixes through a slot window, row by row or gathered, and nothing changes."""
    import realtime_rl.engine.engine as engine_module
    from realtime_rl.engine.slots import slot_view
    from realtime_rl.model.kv_cache import KVCache, SlotRows, SlotWindow

    ways = {"view": lambda slots, lengths: slot_view(slots, CPU),
            "rows": lambda slots, lengths: SlotRows(list(slots), list(lengths)),
            "gather": lambda slots, lengths: torch.tensor(list(slots))}
    monkeypatch.setattr(engine_module, "decode_slots",
                        lambda slots, lengths, gather, device, lineages: ways[way](slots, lengths))
    seen, begin = [], KVCache.begin

    def spy(self, slots, *args, **kwargs):
        seen.append(type(slots))
        return begin(self, slots, *args, **kwargs)

    monkeypatch.setattr(KVCache, "begin", spy)
    ps = prompts(5, 11, 3, 8, 6, 9)
    lengths = [2, 12, 3, 12, 1, 12]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = Engine(moe, max_batch=6, max_seq_len=64).generate(ps, params)
    for p, n, out in zip(ps, lengths, outs):
        ref = generate(moe, p, n, temperature=0.0)
        s = out.samples[0]
        assert s.token_ids == ref.token_ids
        torch.testing.assert_close(torch.tensor(s.raw_logprobs), torch.tensor(ref.raw_logprobs), atol=1e-5, rtol=0)
        assert (s.routing == ref.routing_TLK.numpy()).all()
    assert (SlotWindow in seen) == (way == "view")  # rows 1, 3, 5 run on after the others retire
    assert (SlotRows in seen) == (way == "rows")


def test_raw_and_sampled_logprobs_are_those_of_the_model(moe):
    p = prompts(6)[0]
    out = Engine(moe).generate([p], SamplingParams(temperature=0.7, max_tokens=6, seed=1, ignore_eos=True))[0]
    s = out.samples[0]
    seq = torch.tensor([p + s.token_ids])
    with torch.no_grad():
        logits = moe(seq[:, :-1]).logits_BTV[0, len(p) - 1:]
    targets = torch.tensor(s.token_ids)[:, None]
    raw = torch.log_softmax(logits, -1).gather(1, targets)[:, 0]
    tempered = torch.log_softmax(logits / 0.7, -1).gather(1, targets)[:, 0]
    torch.testing.assert_close(torch.tensor(s.raw_logprobs), raw, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(s.logprobs), tempered, atol=1e-5, rtol=0)


def test_seeded_samples_do_not_depend_on_the_batch(moe):
    a, b = prompts(7, 4)
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=5, n=3, ignore_eos=True)
    alone = Engine(moe).generate([a], params)[0]
    crowded = Engine(moe).generate([b, a, b], params)[1]
    assert [s.token_ids for s in alone.samples] == [s.token_ids for s in crowded.samples]
    assert len({tuple(s.token_ids) for s in alone.samples}) > 1, "n samples should differ"
    # Each of the n samples (sharing one prefill) equals a separate request with seed + i.
    for i, s in enumerate(alone.samples):
        single = Engine(moe).generate([a], SamplingParams(temperature=1.0, max_tokens=8, seed=5 + i,
                                                          ignore_eos=True))[0].samples[0]
        assert single.token_ids == s.token_ids


def test_top_k_and_top_p_restrict_the_support(moe):
    p = prompts(5)[0]
    top1 = Engine(moe).generate([p], SamplingParams(temperature=1.0, top_k=1, max_tokens=8, seed=0,
                                                    ignore_eos=True))[0].samples[0]
    greedy = Engine(moe).generate([p], GREEDY)[0].samples[0]
    assert top1.token_ids == greedy.token_ids[:8]
    nucleus = Engine(moe).generate([p], SamplingParams(temperature=1.0, top_p=0.3, max_tokens=8, seed=0,
                                                       ignore_eos=True, top_logprobs=5))[0].samples[0]
    seq = torch.tensor([p + nucleus.token_ids])
    with torch.no_grad():
        probs = torch.softmax(moe(seq[:, :-1]).logits_BTV[0, len(p) - 1:], -1)
    for t, token in enumerate(nucleus.token_ids):
        sorted_p, order = probs[t].sort(descending=True)
        before = sorted_p.cumsum(0) - sorted_p
        nucleus_set = set(order[before < 0.3].tolist())
        assert token in nucleus_set and len(nucleus_set) < probs.shape[1]
        kept = sorted_p[before < 0.3].sum()
        torch.testing.assert_close(torch.tensor(nucleus.logprobs[t]), (probs[t, token] / kept).log(), atol=1e-4, rtol=0)
        top = nucleus.top_logprobs[t]
        assert [i for i, _ in top] == order[:5].tolist()


def test_stop_tokens_stop_strings_and_lengths(moe, tokenizer):
    model = Qwen3ForCausalLM(tiny_config(vocab_size=tokenizer.vocab_size)).eval()
    engine = Engine(model, tokenizer, max_seq_len=40)
    p = tokenizer.encode("def f(x):")
    free = engine.generate([p], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].samples[0]
    stop_token = free.token_ids[3]
    first = free.token_ids.index(stop_token)
    out = engine.generate([p], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_token]))[0]
    assert out.samples[0].token_ids == free.token_ids[: first + 1] and out.samples[0].finish_reason == "stop"
    stop_text = tokenizer.decode(free.token_ids[4:6])
    if stop_text:
        out = engine.generate([p], SamplingParams(temperature=0.0, max_tokens=12, stop=[stop_text]))[0].samples[0]
        assert out.finish_reason == "stop" and stop_text not in out.text
    long = engine.generate([p], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))[0].samples[0]
    assert long.finish_reason == "length" and len(p) + len(long.token_ids) == 40


def test_ignore_eos_ignores_only_the_default_stop_tokens(tokenizer):
    """As in vLLM: ignore_eos lets a reply run past the turn-ending tokens, not past the tokens or strings the
    request itself asked to stop at."""
    from realtime_rl.engine.requests import Request, Seq, finish_reason

    def reason(ids, **params):
        seq = Seq(Request("r", [1], SamplingParams(**params), None, 0.0), 0, 0, torch.Generator(), list(ids))
        return finish_reason(seq, tokenizer.stop_token_ids, tokenizer, 64)

    end, word = tokenizer.stop_token_ids[0], tokenizer.encode("x")
    assert reason([*word, end]) == "stop" and reason([*word, end], ignore_eos=True) is None
    assert reason([*word, 7], ignore_eos=True, stop_token_ids=[7]) == "stop"
    assert reason(tokenizer.encode("a return"), ignore_eos=True, stop=["return"]) == "stop"


def test_a_stop_string_is_found_in_the_text_it_cuts(tokenizer):
    """Special tokens are left out of the output text, so a stop string that spans one ends the reply and is
    cut from the text (it was looked for in text that kept them: the reply ran on with the string in it)."""
    from realtime_rl.engine.requests import Request, Seq, finish_reason, request_output
    from realtime_rl.model.tokenizer import IM_END

    ids = tokenizer.encode("ab") + tokenizer.encode(IM_END) + tokenizer.encode("cd")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "abcd"
    req = Request("r", [1], SamplingParams(stop=["bc"], ignore_eos=True), None, 0.0)
    seq = Seq(req, 0, 0, torch.Generator(), ids)
    req.seqs.append(seq)
    seq.finish_reason = finish_reason(seq, tokenizer.stop_token_ids, tokenizer, 64)
    assert seq.finish_reason == "stop" and request_output(req, tokenizer, None).samples[0].text == "a"


def test_a_multibyte_stop_string_of_one_byte_tokens_is_found(tokenizer):
    """A byte-level token may be one byte: the tail searched for a stop string is sized in bytes (these 9
    characters are 27 bytes, and were never seen whole in a window of 16 + 9 tokens)."""
    from realtime_rl.engine.requests import Request, Seq, finish_reason

    stop = "日本語の文字列です"
    assert len(tokenizer.encode(stop)) == len(stop.encode())  # characters the tokenizer never learned
    req = Request("r", [1], SamplingParams(stop=[stop], ignore_eos=True), None, 0.0)
    seq = Seq(req, 0, 0, torch.Generator(), tokenizer.encode("ab " + stop))
    assert finish_reason(seq, tokenizer.stop_token_ids, tokenizer, 256) == "stop"


def test_stop_strings_without_a_tokenizer_are_refused(moe):
    with pytest.raises(ValueError, match="no tokenizer"):
        Engine(moe).add_request([1, 2], SamplingParams(stop=["end"]))


def test_requests_join_a_running_batch(moe):
    engine = Engine(moe, max_batch=4)
    engine.add_request(prompts(5)[0], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    engine.step()
    assert engine.num_running == 1
    late = engine.add_request(prompts(6, seed=1)[0], GREEDY)
    engine.step()
    assert engine.num_running == 2
    done = {}
    while engine.has_work():
        done.update({o.request_id: o for o in engine.step()})
    ref = generate(moe, prompts(6, seed=1)[0], 10, temperature=0.0)
    assert done[late].samples[0].token_ids == ref.token_ids


def test_hot_swap_freezes_in_flight_requests_and_records_versions(moe):
    engine = Engine(moe, max_batch=4)
    rid = engine.add_request(prompts(5)[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for _ in range(3):
        engine.step()
    before_swap = len(engine._running[0].token_ids)
    new_state = {k: v + 0.05 * torch.randn_like(v) for k, v in moe.state_dict().items()}
    engine.update_weights(new_state, version=1)
    out = {}
    while engine.has_work():
        out.update({o.request_id: o for o in engine.step()})
    s = out[rid].samples[0]
    assert s.finish_reason == "length" and len(s.token_ids) == 12
    assert before_swap >= 3 and s.versions == [0] * before_swap + [1] * (12 - before_swap)
    assert engine.version == 1 and engine.last_swap_pause_ms is not None and engine.last_swap_pause_ms < 50
    # The live weights are the new ones.
    assert torch.equal(moe.model.embed_tokens.weight, new_state["model.embed_tokens.weight"])


def test_a_bad_weight_update_is_rejected_and_the_old_weights_keep_serving(moe):
    engine = Engine(moe)
    before = engine.generate(prompts(5), GREEDY)[0].samples[0].token_ids
    bad = {k: v.clone() for k, v in moe.state_dict().items()}
    bad["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match="model.norm.weight has shape"):
        engine.update_weights(bad, version=1)
    missing = dict(list(moe.state_dict().items())[1:])
    with pytest.raises(ValueError, match="missing"):
        engine.update_weights(missing, version=1)
    assert engine.version == 0 and engine.generate(prompts(5), GREEDY)[0].samples[0].token_ids == before


@pytest.mark.parametrize("prompt, params, message", [
    ([], SamplingParams(), "empty"),
    ([600], SamplingParams(), "token ids must be in"),
    (list(range(64)), SamplingParams(), "context holds"),
    ([1, 2], SamplingParams(n=9), "exceeds the engine's batch"),
    ([1.9, 2], SamplingParams(), "position 0 holds 1.9"),  # was read as token 1
    ([3, True], SamplingParams(), "position 1 holds True"),
    ("123", SamplingParams(), "not text"),  # was read as tokens 1, 2, 3
    ([1, 2], SamplingParams(stop_token_ids=[600]), "stop_token_ids must be in 0..511"),
])
def test_bad_requests_are_refused(moe, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        Engine(moe, max_batch=8, max_seq_len=64).add_request(prompt, params)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n must"), (dict(top_logprobs=21), "top_logprobs"),
    (dict(stop=[""]), "stop strings"), (dict(stop="abc"), "list of strings"), (dict(seed=2**64), "seed must"),
    (dict(seed=-(2**63) - 1), "seed must"),
    # wrong types: before, these passed here and failed on the engine's thread, ending it for every caller
    (dict(n=2.0), "n must be an integer"), (dict(seed=1.5), "seed must be an integer or None"),
    (dict(stop_token_ids=5), "stop_token_ids must be a list of integers"), (dict(max_tokens=2.5), "max_tokens"),
    (dict(top_k=2.5), "top_k must be an integer"), (dict(temperature=float("nan")), "temperature must be a finite"),
    (dict(ignore_eos="yes"), "ignore_eos must be a bool"),
    # past int64 (torch.tensor overflowed on the engine's thread), and an iterator the checks used up
    (dict(top_k=2**31), "top_k must be in"), (dict(stop={"a"}), "stop must be a list of strings"),
])
def test_sampling_params_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_stop_strings_given_as_a_tuple_are_kept_as_a_list():
    assert SamplingParams(stop=("x", "y")).stop == ["x", "y"]


def test_generate_returns_its_own_requests_whatever_else_finishes(moe):
    """Outputs of requests queued before (add_request, a call that timed out) counted as this call's: it returned
    early and raised KeyError."""
    engine = Engine(moe, max_batch=8, max_seq_len=64)
    with pytest.raises(TimeoutError):
        engine.generate(prompts(3, 2), GREEDY, timeout_s=0.0)
    engine.add_request(prompts(4)[0], GREEDY)
    [out] = engine.generate(prompts(3, seed=1), GREEDY)
    assert out.prompt_ids == prompts(3, seed=1)[0] and len(out.samples[0].token_ids) == 10


def test_prefill_runs_the_lm_head_at_each_rows_last_position_only(moe):
    """[B, T, vocab] logits for every prompt position: GiBs at a real vocabulary, for B rows used."""
    shapes = []
    moe.lm_head.register_forward_hook(lambda module, args, out: shapes.append(tuple(out.shape)))
    Engine(moe, max_batch=8, max_seq_len=64).generate(prompts(20, 3), GREEDY)
    assert shapes[0] == (2, moe.config.vocab_size)  # the prefill's; decode steps follow


def test_a_restart_after_a_stop_that_timed_out_serves_again(moe):
    """stop() timed out mid-step, then start() returned without starting anything: the old thread left its loop
    and every later request failed with EngineStopped."""
    engine = Engine(moe, max_batch=2)
    step, stepping = engine.step, threading.Event()

    def slow():
        stepping.set()
        time.sleep(0.3)
        return step()

    engine.step = slow
    aengine = AsyncEngine(engine).start()

    def long_request() -> None:
        with contextlib.suppress(EngineStopped):  # ended by the stop
            aengine.generate_sync(prompts(3)[0], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True),
                                  timeout_s=30)

    caller = threading.Thread(target=long_request)
    caller.start()
    assert stepping.wait(10)
    aengine.stop(timeout_s=0.01)
    engine.step = step
    aengine.start()
    try:
        out = aengine.generate_sync(prompts(3)[0], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                                    timeout_s=30)  # more steps than the old thread's last
        assert out.samples[0].finish_reason == "length"
    finally:
        aengine.stop()
        caller.join(10)


def test_numpy_and_tensor_integers_are_token_ids_and_seeds(moe):
    engine = Engine(moe, max_batch=2)
    params = SamplingParams(temperature=1.0, max_tokens=3, seed=np.int64(7), top_k=np.int32(5))
    outs = engine.generate([np.array([5, 6, 7]), torch.tensor([5, 6, 7])], params)
    assert outs[0].prompt_ids == outs[1].prompt_ids == [5, 6, 7]
    assert outs[0].samples[0].token_ids == outs[1].samples[0].token_ids  # same seed, same prompt


def test_an_aborted_request_is_told_at_once_even_behind_one_that_waits_for_slots(moe):
    engine = Engine(moe, max_batch=2)
    busy = engine.add_request(prompts(3)[0], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    engine.step()  # it holds one slot of two
    engine.add_request(prompts(4)[0], SamplingParams(temperature=0.0, max_tokens=3, n=2))  # waits for both
    queued = engine.add_request(prompts(5)[0], GREEDY)  # behind it
    engine.abort(queued)
    told = engine.step()
    assert [(o.request_id, o.samples[0].finish_reason if o.samples else None) for o in told] == [(queued, None)]
    assert queued not in engine._requests and busy in engine._requests


def test_async_engine_serves_concurrent_callers_and_streams(moe):
    ps = prompts(3, 5, 7, 9, 4, 6)
    refs = [generate(moe, p, 10, temperature=0.0).token_ids for p in ps]

    async def main():
        with AsyncEngine(Engine(moe, max_batch=4)) as aengine:
            outs = await asyncio.gather(*(aengine.generate(p, GREEDY, timeout_s=60) for p in ps))
            streamed = [e.token async for e in aengine.stream(ps[0], GREEDY, timeout_s=60) if e.token is not None]
        return outs, streamed

    outs, streamed = asyncio.run(main())
    assert [o.samples[0].token_ids for o in outs] == refs
    assert streamed == refs[0]


def test_async_engine_backpressure_timeouts_and_threads(moe):
    slow = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with AsyncEngine(Engine(moe, max_batch=2), max_pending=2) as aengine:
        results = []
        threads = [threading.Thread(target=lambda p=p: results.append(aengine.generate_sync(p, GREEDY, 60)))
                   for p in prompts(3, 4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(results) == 2

        async def overload():
            first = asyncio.ensure_future(aengine.generate(prompts(3)[0], slow, timeout_s=60))
            second = asyncio.ensure_future(aengine.generate(prompts(4)[0], slow, timeout_s=60))
            await asyncio.sleep(0.01)
            with pytest.raises(EngineOverloaded):
                await aengine.generate(prompts(5)[0], slow, timeout_s=60)
            await asyncio.gather(first, second)

        asyncio.run(overload())
        with pytest.raises(TimeoutError):
            aengine.generate_sync(prompts(3)[0], SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True),
                                  timeout_s=0.001)
        # The timed-out request was aborted: its slot is free again and the engine still serves.
        assert aengine.generate_sync(prompts(3)[0], GREEDY, 60).samples[0].finish_reason == "length"


def test_an_output_queued_before_the_deadline_is_delivered_after_it(moe):
    """The caller reads the stream late (a slow client): the finished output already waiting is its answer,
    not a TimeoutError."""
    engine, finished = Engine(moe, max_batch=2), threading.Event()
    step = engine.step

    def step_and_tell():
        outs = step()
        if outs:  # returned after the output was handed to the caller's loop
            finished.set()
        return outs

    engine.step = step_and_tell

    async def main():
        with AsyncEngine(engine) as aengine:
            events = aengine.stream(prompts(3)[0], GREEDY, timeout_s=0.5)
            await anext(events)
            await asyncio.sleep(0.6)  # past the deadline
            while not finished.is_set():
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.01)  # the loop takes in what the engine thread sent
            return [e async for e in events]

    rest = asyncio.run(main())
    assert rest[-1].output is not None and rest[-1].output.samples[0].finish_reason == "length"


def test_generate_frees_its_place_in_the_queue_when_it_returns(moe):
    """With max_pending=1, one generate after another: the first one's request no longer counts as pending
    (the stream it reads is closed when it returns, not when it is garbage-collected)."""

    async def main():
        with AsyncEngine(Engine(moe, max_batch=2), max_pending=1) as aengine:
            return [await aengine.generate(p, GREEDY, timeout_s=60) for p in prompts(3, 4)]

    assert [len(o.samples[0].token_ids) for o in asyncio.run(main())] == [10, 10]


def test_a_stream_whose_consumer_stops_reading_stops_counting_once_its_request_finishes(moe):
    """A gateway stream whose client stops reading (its socket still open) is suspended at a yield: its request
    counted as pending until the consumer drained it, and max_pending such streams refused everyone else."""

    async def main():
        with AsyncEngine(Engine(moe, max_batch=2), max_pending=1) as aengine:
            stalled = aengine.stream(prompts(3)[0], GREEDY, timeout_s=60)
            await anext(stalled)  # one token read, then nothing more
            deadline = time.monotonic() + 30
            while aengine._pending and time.monotonic() < deadline:  # the engine finishes it meanwhile
                await asyncio.sleep(0.01)
            out = await aengine.generate(prompts(4)[0], GREEDY, timeout_s=60)  # was EngineOverloaded
            await stalled.aclose()
            return out, aengine._pending

    out, pending = asyncio.run(main())
    assert len(out.samples[0].token_ids) == 10 and pending == 0  # counted once, not twice


def test_a_callback_that_raises_aborts_only_its_request(moe):
    engine = Engine(moe, max_batch=4)
    slow = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def broken(*_):
        raise RuntimeError("the client went away")

    bad = engine.add_request(prompts(3)[0], slow, on_update=broken)
    good = engine.add_request(prompts(4)[0], slow)
    outs = {}
    while engine.has_work():
        outs.update({o.request_id: o.samples[0] for o in engine.step()})
    assert outs[bad].finish_reason == "abort" and len(outs[bad].token_ids) == 1
    assert outs[good].finish_reason == "length" and len(outs[good].token_ids) == 8


def test_an_abort_while_the_request_is_being_prefilled_is_not_lost(moe):
    engine = Engine(moe, max_batch=4)
    rid = "r"

    def abort_on_first_token(_rid, _index, token, output):  # runs between the prefill and joining the batch
        if token is not None:
            engine.abort(rid)

    engine.add_request(prompts(5)[0], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), rid,
                       abort_on_first_token)
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert outs[0].samples[0].finish_reason == "abort" and len(outs[0].samples[0].token_ids) == 1


def test_a_callback_may_queue_a_request_when_told_of_an_abort(moe):
    engine = Engine(moe, max_batch=4)
    queued = []

    def resubmit(_rid, _index, _token, output):
        if output is not None and not output.samples:  # aborted before it started
            queued.append(engine.add_request(prompts(3)[0], GREEDY))

    rid = engine.add_request(prompts(4)[0], GREEDY, on_update=resubmit)
    engine.abort(rid)  # still waiting: told at the next step's admission
    done: list = []
    worker = threading.Thread(target=lambda: [done.extend(engine.step()) for _ in range(12)], daemon=True)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "the engine deadlocked on a callback that called back into it"
    assert [o.request_id for o in done] == [rid, *queued] and len(queued) == 1


def test_other_weights_under_the_same_version_reuse_nothing(moe):
    engine = Engine(moe, max_batch=2, max_seq_len=64)
    p = prompts(12)[0]
    out = engine.generate([p], GREEDY)[0].samples[0]
    engine.update_weights({k: v + 0.01 for k, v in moe.named_parameters()}, version=0)
    engine.step()
    engine.generate([p + out.token_ids], GREEDY)
    assert engine.prefix_hit_tokens == 0  # version 0 again, but not the weights that computed the cache


def test_generate_checks_every_prompt_before_queueing_any(moe):
    engine = Engine(moe, max_batch=4, max_seq_len=64)
    with pytest.raises(ValueError, match="context holds"):
        engine.generate([[1, 2], list(range(64))], GREEDY)
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        engine.generate([[1, 2], [3]], [GREEDY])
    assert not engine.has_work()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_engine_thread_fails_its_callers_at_once_not_at_their_timeouts(moe):
    engine = Engine(moe, max_batch=2)
    step, steps = engine.step, []

    def failing_step():
        steps.append(1)
        if len(steps) == 3:
            raise RuntimeError("device lost")
        return step()

    engine.step = failing_step
    with AsyncEngine(engine) as aengine:
        t0 = time.monotonic()
        long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        with pytest.raises(RuntimeError, match="engine thread died"):
            aengine.generate_sync(prompts(3)[0], long, 60)
        assert time.monotonic() - t0 < 30
        with pytest.raises(RuntimeError, match="engine thread died"):
            aengine.generate_sync(prompts(3)[0], GREEDY, 60)  # and every later caller

def test_stopping_the_engine_ends_its_callers_at_once_and_a_restart_serves_again(moe):
    engine = Engine(moe, max_batch=2)
    step, started = engine.step, threading.Event()

    def stepping():
        started.set()
        time.sleep(0.01)  # so that the request is still running when stop() comes
        return step()

    engine.step = stepping
    aengine = AsyncEngine(engine).start()
    errors: list[BaseException] = []

    def wait_long() -> None:
        try:
            aengine.generate_sync(prompts(3)[0], SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True),
                                  timeout_s=600)
        except BaseException as e:  # noqa: BLE001 (checked below)
            errors.append(e)

    callers = [threading.Thread(target=wait_long) for _ in range(2)]  # both slots in use when it stops
    for caller in callers:
        caller.start()
    assert started.wait(60)
    deadline = time.monotonic() + 60
    while engine.slots.free and time.monotonic() < deadline:
        time.sleep(0.01)
    aengine.stop()
    for caller in callers:
        caller.join(60)  # told now, not at its 600 s timeout
    assert not any(c.is_alive() for c in callers) and all(isinstance(e, EngineStopped) for e in errors), errors
    assert len(errors) == 2 and sorted(engine.slots.free) == [0, 1]  # the aborted requests' slots came back
    with pytest.raises(EngineStopped):
        aengine.generate_sync(prompts(3)[0], GREEDY, 60)
    aengine.start()  # a restarted engine serves new requests, on every slot (they leaked: it hung)
    try:
        both = SamplingParams(temperature=0.0, max_tokens=4, n=2, ignore_eos=True)
        assert [s.finish_reason for s in aengine.generate_sync(prompts(3)[0], both, 20).samples] == ["length"] * 2
    finally:
        aengine.stop()


def test_an_output_finished_just_before_a_stop_is_returned_not_turned_into_an_error(moe):
    engine = Engine(moe, max_batch=2)
    with AsyncEngine(engine) as aengine:
        tell = engine._output

        def stopped_meanwhile(req, reason):  # the stop lands between the last step and the caller's read
            aengine.error = EngineStopped("the engine was stopped")
            return tell(req, reason)

        engine._output = stopped_meanwhile
        out = aengine.generate_sync(prompts(3)[0], GREEDY, 60)
        assert out.samples[0].finish_reason == "length" and len(out.samples[0].token_ids) == 10

        aengine.error = None  # the stop above was make-believe: the engine serves on

        async def streamed():
            async with contextlib.aclosing(aengine.stream(prompts(3)[0], GREEDY, 60)) as events:
                return [e async for e in events][-1].output

        assert asyncio.run(streamed()).samples[0].finish_reason == "length"


def test_a_row_without_top_p_keeps_its_whole_distribution_beside_a_row_with_one():
    """The fp32 cumsum of a peaked distribution reaches 1 long before its tail: a top_p = 1 row sharing a batch
    with a filtered row must not lose that tail (its logprobs would depend on its neighbours)."""
    from realtime_rl.model.sampling import sampling_logprobs

    logits = torch.randn(2, 151_936, generator=torch.Generator().manual_seed(0)) * 8
    logits[:, 0] = 60.0  # peaked
    both, _ = sampling_logprobs(logits, torch.ones(2), torch.zeros(2, dtype=torch.long), torch.tensor([1.0, 0.9]))
    alone, _ = sampling_logprobs(logits[:1], torch.ones(1), torch.zeros(1, dtype=torch.long), torch.tensor([1.0]))
    assert torch.isfinite(both[0]).all() and torch.equal(both[0], alone[0])
    assert torch.isinf(both[1]).any()  # the filtered row is filtered


def test_a_vanishing_top_p_keeps_the_top_token(moe):
    """5e-324 rounds to 0 in fp32; the engine must still sample (the top token) rather than die."""
    p = prompts(5)[0]
    out = Engine(moe).generate([p], SamplingParams(temperature=1.0, top_p=5e-324, max_tokens=4, seed=0,
                                                   ignore_eos=True))[0].samples[0]
    assert out.token_ids == Engine(moe).generate([p], SamplingParams(temperature=0.0, max_tokens=4,
                                                                      ignore_eos=True))[0].samples[0].token_ids


def test_prefix_caching_reuses_an_agents_previous_turn_and_changes_nothing(moe):
    """Turn 2 extends turn 1 (its prompt, its output, a tool result): the cached engine prefills only the
    new tokens, yet returns the same tokens, logprobs and routing as an engine that recomputes all."""
    cached, plain = Engine(moe, max_batch=4, max_seq_len=128), Engine(moe, max_batch=4, max_seq_len=128,
                                                                        prefix_caching=False)
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=3, ignore_eos=True)
    a, b = prompts(20, 9, seed=1)
    first = [e.generate([a, b], params)[0].samples[0] for e in (cached, plain)]
    assert first[0].token_ids == first[1].token_ids
    turn2 = a + first[0].token_ids + prompts(6, seed=2)[0]
    hits_before = cached.prefix_hit_tokens
    outs = [e.generate([turn2], params)[0].samples[0] for e in (cached, plain)]
    assert cached.prefix_hit_tokens - hits_before == len(a) + len(first[0].token_ids) - 1
    assert plain.prefix_hit_tokens == 0
    assert outs[0].token_ids == outs[1].token_ids
    torch.testing.assert_close(torch.tensor(outs[0].logprobs), torch.tensor(outs[1].logprobs), atol=1e-5, rtol=0)
    assert outs[0].routing.shape == outs[1].routing.shape == (len(turn2) + 7, 3, 2)
    assert (outs[0].routing == outs[1].routing).all()


def test_prefix_cache_is_dropped_at_a_weight_swap(moe):
    engine = Engine(moe, max_batch=2, max_seq_len=64)
    p = prompts(12)[0]
    out = engine.generate([p], GREEDY)[0].samples[0]
    engine.update_weights({k: v.clone() for k, v in moe.named_parameters()}, version=1)
    engine.step()  # the swap applies between steps
    engine.generate([p + out.token_ids], GREEDY)
    assert engine.prefix_hit_tokens == 0  # the prefix was computed by version 0's weights


def test_rollout_engines_reuse_prefixes_up_to_a_bounded_age(moe):
    """prefix_max_age 1 (RL rollouts with staleness bound 1): after one swap the next turn reuses the keys/values
    version 0 computed and samples its new tokens with version 1; after a second swap they are too old."""
    engine = Engine(moe, max_batch=2, max_seq_len=96, prefix_max_age=1)
    p = prompts(12)[0]
    out = engine.generate([p], GREEDY)[0].samples[0]
    for version in (1, 2):
        engine.update_weights({k: v.clone() for k, v in moe.named_parameters()}, version=version)
        engine.step()
        hits = engine.prefix_hit_tokens
        turn = engine.generate([p + out.token_ids], GREEDY)[0].samples[0]
        assert set(turn.versions) == {version}
        # version 1 reuses version 0's prefix; version 2 must not (its oldest keys/values are 2 versions old)
        assert engine.prefix_hit_tokens - hits == (len(p) + len(out.token_ids) - 1 if version == 1 else 0)


def test_a_new_sequence_never_gets_older_keys_values(moe):
    """Another episode sharing only the prompt (the system prompt, say) with a stale slot prefills afresh, so a
    sequence whose every token the current weights generated is exactly on-policy; the same weights reuse it."""
    engine = Engine(moe, max_batch=2, max_seq_len=96, prefix_max_age=2)
    shared = prompts(12)[0]
    engine.generate([shared + [5, 6]], GREEDY)
    engine.update_weights({k: v.clone() for k, v in moe.named_parameters()}, version=1)
    engine.step()
    engine.generate([shared + [7, 8]], GREEDY)
    assert engine.prefix_hit_tokens == 0
    engine.generate([shared + [9, 10]], GREEDY)  # version 1 computed the last one: shared is reused
    assert engine.prefix_hit_tokens == len(shared)


def run_staggered(engine, arrivals, params, before_step=None):
    """Add each prompt at its step (arrivals: [(step, prompt)]) and step until all finish; outputs in order.
    `before_step(engine, step)` runs before each step's arrivals."""
    ids, results, step = {}, {}, 0
    while len(results) < len(arrivals):
        if before_step is not None:
            before_step(engine, step)
        for i, (at, prompt) in enumerate(arrivals):
            if at == step:
                ids[engine.add_request(prompt, SamplingParams(**{**params, "seed": 10 * i}))] = i
        results.update({ids[out.request_id]: out.samples[0] for out in engine.step()})
        step += 1
    return [results[i] for i in range(len(arrivals))]


def assert_same_samples(xs, ys):
    for x, y in zip(xs, ys, strict=True):
        assert x.token_ids == y.token_ids and x.versions == y.versions
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)
        assert x.routing.shape == y.routing.shape and (x.routing == y.routing).all()


def test_a_groups_episodes_share_one_prefill_and_in_flight_prompts_are_copied_changing_nothing(moe):
    """Three requests with one prompt in one step prefill it once; a request arriving while another with the
    same system prompt decodes copies that prefix instead of recomputing it. Tokens, logprobs and routing
    are those of an engine that recomputes everything."""
    system, task_a, task_b = prompts(24, 5, 7, seed=4)
    arrivals = [(0, system + task_a)] * 3 + [(0, task_b), (2, system + task_b), (3, system + task_a)]
    params = dict(temperature=1.0, max_tokens=6, ignore_eos=True)
    engine = Engine(moe, max_batch=8, max_seq_len=96)
    outs = run_staggered(engine, arrivals, params)
    # the two copies of the first prompt, then the system prompt and all of system + task_a (one token kept
    # for its logits) from the first request, still decoding
    assert engine.prefix_hit_tokens == 2 * len(system + task_a) + len(system) + len(system + task_a) - 1
    assert_same_samples(outs, run_staggered(Engine(moe, max_batch=8, max_seq_len=96, prefix_caching=False),
                                            arrivals, params))


@pytest.mark.parametrize("by_row", [False, True])
def test_decode_reads_the_prompts_rows_hold_alike_once_and_changes_nothing(moe, monkeypatch, by_row):
    """Cascade decode attention: rows whose slots hold copies of one prefill (a request's samples, a group's
    requests admitted together, a system prompt copied from a sequence in flight, across a weight swap) read
    those keys/values once per decode step, nested (the system prompt for all, each task's prompt for its
    group), and every token, logprob and routing is that of an engine that recomputes and reads every row's
    own keys/values. The rest of each row's keys are read in one call or row by row."""
    import dataclasses

    import realtime_rl.engine.engine as engine_module
    import realtime_rl.engine.slots as slots_module
    from realtime_rl.model.kv_cache import SharedRows

    monkeypatch.setattr(slots_module, "RUN_CALL_POSITIONS", 0)  # any run that saves a position is read once
    seen: list[SharedRows] = []

    def cascade_when_shared(slots, lengths, gather, device, lineages):
        shared = lineages and slots_module.shared_runs(slots, lineages, lengths, device)
        if shared:
            seen.append(shared)
            return dataclasses.replace(shared, by_row=by_row)
        return slots_module.decode_slots(slots, lengths, gather, device)

    monkeypatch.setattr(engine_module, "decode_slots", cascade_when_shared)
    system, task_a, task_b, task_c = prompts(24, 5, 7, 6, seed=5)
    arrivals = ([(0, system + task_a)] * 3 + [(0, task_c), (1, system + task_b), (1, system + task_b),
                                             (3, system + task_a), (4, system + task_c)])
    params = dict(temperature=1.0, max_tokens=8, ignore_eos=True)

    def swap_at_step_5(engine, step):  # what is in flight keeps its keys/values, and they are still shared
        if step == 5:
            engine.update_weights({k: v.clone() for k, v in moe.named_parameters()}, version=1)

    def run(**kwargs):
        engine = Engine(moe, max_batch=10, max_seq_len=96, **kwargs)
        return run_staggered(engine, arrivals, params, before_step=swap_at_step_5)

    outs = run()
    # The three first requests share their whole prompt; the later ones copy the system prompt (or all of a
    # prompt but its last token) from sequences in flight: runs nest, the system prompt's first.
    first = seen[0]
    assert [(run.rows.tolist(), run.start, run.end) for run in first.levels[0]] == [([0, 1, 2], 0, 29)]
    nested = [shared for shared in seen if len(shared.levels) >= 2]
    assert nested and all(shared.levels[0][0].end == len(system) for shared in nested)
    assert_same_samples(outs, run(prefix_caching=False, cascade_decode=False))


def test_sequences_in_flight_lend_nothing_computed_by_older_weights(moe):
    engine = Engine(moe, max_batch=4, max_seq_len=96, prefix_max_age=2)
    shared = prompts(16)[0]
    engine.add_request(shared + [1], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    engine.step()
    engine.update_weights({k: v.clone() for k, v in moe.named_parameters()}, version=1)
    engine.step()  # swapped: the first request decodes on, its prompt's keys/values version 0's
    assert engine.num_running == 1
    engine.add_request(shared + [2], GREEDY)
    engine.step()
    assert engine.prefix_hit_tokens == 0


def test_the_grpo_batch_benchmark_times_both_ways(moe):
    from realtime_rl.bench.engine import grpo_batch_s

    m = grpo_batch_s(moe, repeats=1, groups=2, group_size=3, system_len=20, task_len=4, new_tokens=3)
    assert m["grpo_shared_s"] > 0 and m["grpo_copied_s"] > 0 and m["grpo_recomputed_s"] > 0
    assert m["grpo_sharing_speedup"] == pytest.approx(m["grpo_recomputed_s"] / m["grpo_shared_s"])
    assert m["grpo_cascade_speedup"] == pytest.approx(m["grpo_copied_s"] / m["grpo_shared_s"])


def _ragged_runs_across_a_swap(model, engines, ps):
    """Each engine (built by engines(), in turn, on the shared model): one row, then a ragged batch of greedy,
    sampled and short requests, then a request across a hot swap; the model is restored after each. Returns
    each engine's outputs and the engines."""
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, seed=3, n=2, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)  # frees a slot mid-batch: scattered
    params = ([GREEDY, sampled, short, sampled] + [GREEDY] * len(ps))[: len(ps) - 1]
    new_state = {k: v + 0.05 * torch.randn_like(v, generator=torch.Generator().manual_seed(1))
                 for k, v in model.state_dict().items()}
    original = {k: v.clone() for k, v in model.state_dict().items()}
    results, built = [], []
    for make in engines:
        engine = make()
        first = engine.generate(ps[:1], GREEDY) + engine.generate(ps[1:], params)  # one row, then ragged
        rid = engine.add_request(ps[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        for _ in range(4):
            engine.step()
        engine.update_weights(new_state, version=1)
        swapped = {}
        while engine.has_work():
            swapped.update({o.request_id: o for o in engine.step()})
        results.append(first + [swapped[rid]])
        engine.update_weights(original, version=0)  # the model is shared: restore it for the next engine
        engine.step()
        built.append(engine)
    for name, p in model.named_parameters():
        assert torch.equal(p, original[name]), name
    return results, built


def _assert_same_outputs(results):
    for eager, other in zip(*results):
        for a, b in zip(eager.samples, other.samples):
            assert a.token_ids == b.token_ids and a.versions == b.versions
            torch.testing.assert_close(torch.tensor(a.raw_logprobs), torch.tensor(b.raw_logprobs), atol=1e-5, rtol=0)
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
            assert (a.routing == b.routing).all()
    assert results[1][-1].samples[0].versions == [0] * 5 + [1] * 7


@pytest.mark.slow
def test_the_compiled_decode_step_changes_nothing_and_survives_swaps(moe):
    """compile_decode: the same tokens, logprobs, routing and versions as the eager engine, for one row and
    for ragged batches, greedy and sampled, across a hot weight swap (which must not recompile)."""
    import torch._dynamo

    torch._dynamo.reset()

    def compiled():
        engine = Engine(moe, max_batch=8, max_seq_len=64, compile_decode=True)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2  # the constructor's: one row; more
        return engine

    results, _ = _ragged_runs_across_a_swap(
        moe, [lambda: Engine(moe, max_batch=8, max_seq_len=64), compiled], prompts(5, 11, 3, 8, 1))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs == 2, f"{graphs} graphs after the warm-up's 2: recompiled at a swap or a new batch size"
    _assert_same_outputs(results)


def test_the_static_shape_decode_step_changes_nothing_and_survives_swaps(moe):
    """graphs=True (on a GPU: CUDA graphs; on the CPU the same padded static-shape step, run eagerly): the same
    tokens, logprobs, routing and versions as the engine's other decode paths, for one row and ragged
    batches of several buckets, greedy and sampled, across a hot swap (which copies into the live weights)."""
    ps = prompts(5, 11, 3, 8, 1, 70)  # the last one's keys outgrow the first length bucket (64)
    results, engines = _ragged_runs_across_a_swap(
        moe, [lambda g=g: Engine(moe, max_batch=8, max_seq_len=96, graphs=g) for g in (False, True)], ps)
    assert engines[0].graphs is None and engines[1].graphs is not None
    assert engines[1].cache.num_slots == 9  # the padding rows' scratch slot
    _assert_same_outputs(results)


def test_padding_rows_write_only_the_scratch_slot(moe):
    from realtime_rl.engine.graphs import batch_buckets, length_bucket

    assert batch_buckets(96) == [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96]
    assert batch_buckets(5) == [1, 2, 4, 5] and batch_buckets(1) == [1]
    assert [length_bucket(n, 4096) for n in (1, 64, 65, 700, 4096)] == [64, 64, 128, 1024, 4096]
    assert length_bucket(90, 80) == 80
    engine = Engine(moe, max_batch=8, max_seq_len=32, graphs=True)
    engine.generate(prompts(4, 6, 5), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    held = {s for s in range(8) if engine.cache.k_LSHPD[0][s].abs().sum() > 0}
    assert len(held) == 3  # three rows padded to a bucket of 4: the fourth row wrote only the scratch slot
    assert engine.cache.k_LSHPD[0][8, :, 0].abs().sum() > 0 and engine.cache.k_LSHPD[0][8, :, 1:].abs().sum() == 0


def test_graphs_and_compiled_decode_are_refused_together(moe):
    with pytest.raises(ValueError, match="pick one"):
        Engine(moe, max_batch=2, max_seq_len=16, graphs=True, compile_decode=True)


def test_prefill_wait_batches_new_requests_while_others_decode(moe):
    engine = Engine(moe, max_batch=4, max_seq_len=64, prefill_wait_ms=200)
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.add_request(prompts(5)[0], long)
    engine.step()
    assert engine.num_running == 1 and engine.num_waiting == 0  # nothing decoding: admitted at once
    engine.add_request(prompts(6, seed=1)[0], long)
    engine.step()
    engine.add_request(prompts(7, seed=2)[0], long)
    engine.step()
    assert engine.num_running == 1 and engine.num_waiting == 2  # they wait for each other, the first decodes on
    time.sleep(0.21)
    engine.step()
    assert engine.num_running == 3 and engine.num_waiting == 0  # one prefill for both
    with pytest.raises(ValueError, match="prefill_wait_ms"):
        Engine(moe, max_batch=2, max_seq_len=16, prefill_wait_ms=-1)


def test_engine_stats_account_for_its_steps(moe):
    engine = Engine(moe, max_batch=4, max_seq_len=64)
    engine.generate(prompts(5, 7), [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 6)])
    stats = engine.stats
    # Both prefilled in the first step, which samples their first tokens and decodes their second.
    assert stats.prefills == 1 and stats.steps == engine.steps == 5
    assert stats.decode_steps == 5 and stats.decode_rows == 2 + 2 + 1 + 1 + 1
    assert stats.busy_s >= stats.prefill_s + stats.decode_s > 0 and stats.prefill_s > 0
