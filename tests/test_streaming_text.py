# ruff: noqa: RUF001  (look-alike characters in test text)
"""Streaming text through `EngineCore` with a tokenizer, checked with hypothesis.

Texts are encoded, then their ids are fed back one per step as the "sampled" tokens of requests
with a 1-token prompt. The joined `out.texts` must equal one-shot `Tokenizer.decode`, stop
strings must cut the text where the first stop to complete (earliest end, then earliest start)
begins, and nothing emitted is ever taken back.
"""

import numpy as np
import pytest
import text_fixtures
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aieng.core import EngineCore, Tokenizer

# pytest fixtures shared with test_tokenizer_parity.py
tokenizer_dirs = text_fixtures.tokenizer_dirs
tok_kind = text_fixtures.tok_kind

FFFD = "\ufffd"
SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# Multi-byte characters are drawn often: CJK, emoji (with ZWJ/VS16), Burmese, combining marks.
MULTIBYTE = "日本語中文한국어🙂👍🏽👨‍👩‍👧❤️မြန်မာé\u0301ñ\u0303עברית العربية\t  \n"
TEXT = st.text(
    st.one_of(
        st.characters(exclude_categories=("Cs",)),
        st.sampled_from(MULTIBYTE),
        st.sampled_from("abc STOP<>|. "),
    ),
    min_size=1,
    max_size=40,
)


@pytest.fixture(scope="module")
def tok(tokenizer_dirs, tok_kind) -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_dirs[tok_kind])


def stream(tok, requests: dict[str, dict], ids_of: dict[str, list[int]]):
    """Runs the requests side by side, request r being fed ids_of[r] one per step.

    Returns {request_id: (deltas, finished)} where deltas[k] is the text emitted at step k.
    """
    core = EngineCore(num_blocks=256, block_size=16, max_model_len=8192, tokenizer=tok)
    for rid, kwargs in requests.items():
        core.add_request(rid, [1], max_tokens=len(ids_of[rid]), ignore_eos=True, **kwargs)
    deltas: dict[str, list[str]] = {rid: [] for rid in requests}
    finished = {}
    step = 0
    while core.has_unfinished():
        plan = core.schedule()
        rows = plan.sample_request_rows
        rids = [plan.request_ids[int(r)] for r in rows]
        sampled = np.array([ids_of[rid][step] for rid in rids], dtype=np.int64)
        out = core.update(sampled)
        assert len(out.texts) == len(out.rows) == len(out.token_ids)
        got = {plan.request_ids[int(r)]: t for r, t in zip(out.rows, out.texts, strict=True)}
        assert set(got) == set(rids)
        for rid in rids:
            deltas[rid].append(got[rid])
        for f in out.finished:
            finished[f.request_id] = f
        step += 1
        assert step <= max(len(v) for v in ids_of.values())
    core.check_invariants()
    return {rid: (deltas[rid], finished[rid]) for rid in requests}


def expected_stop(text: str, stops: list[str]) -> tuple[int, int, str] | None:
    """(start, end, stop) of the stop string that completes first in text, if any."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not found:
        return None
    end, start, stop = min(found, key=lambda f: (f[0], f[1]))
    return start, end, stop


def assert_no_take_back(deltas: list[str], final: str) -> None:
    emitted = ""
    for d in deltas:
        emitted += d
        assert final.startswith(emitted), (emitted, final)


# ------------------------------------------------------------------ plain streaming


@SETTINGS
@given(text=TEXT, skip=st.booleans())
def test_joined_deltas_equal_one_shot_decode(tok, text, skip):
    ids = tok.encode(text, add_special_tokens=False)
    if not ids:
        return
    expected = tok.decode(ids, skip_special_tokens=skip)
    res = stream(tok, {"r": {"skip_special_tokens": skip}}, {"r": ids})
    deltas, fin = res["r"]
    joined = "".join(deltas)
    assert joined == expected
    assert_no_take_back(deltas, expected)
    if FFFD not in expected:
        assert all(FFFD not in d for d in deltas)
    assert fin.finish_reason == "length"
    assert fin.stop_reason is None
    assert fin.num_output_tokens == len(ids)


@SETTINGS
@given(texts=st.lists(TEXT, min_size=2, max_size=4))
def test_concurrent_requests_stream_independently(tok, texts):
    ids_of = {f"r{i}": tok.encode(t, add_special_tokens=False) or [5] for i, t in enumerate(texts)}
    res = stream(tok, {rid: {} for rid in ids_of}, ids_of)
    for rid, ids in ids_of.items():
        deltas, fin = res[rid]
        assert "".join(deltas) == tok.decode(ids)
        assert fin.num_output_tokens == len(ids)


@SETTINGS
@given(data=st.data(), skip=st.booleans())
def test_random_short_id_streams_match_one_shot(tok, data, skip):
    """Arbitrary ids (invalid UTF-8, byte tokens, specials) shorter than the forced-emit window."""
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), min_size=1, max_size=15))
    expected = tok.decode(ids, skip_special_tokens=skip)
    deltas, _ = stream(tok, {"r": {"skip_special_tokens": skip}}, {"r": ids})["r"]
    assert "".join(deltas) == expected
    assert_no_take_back(deltas, expected)


@SETTINGS
@given(text=TEXT, data=st.data())
def test_out_of_vocabulary_ids_decode_to_nothing(tok, text, data):
    ids = tok.encode(text, add_special_tokens=False)
    oov = [tok.vocab_size, tok.vocab_size + 7, 10**6, 2**31 - 1]
    mixed = list(ids)
    for _ in range(data.draw(st.integers(1, 4))):
        mixed.insert(data.draw(st.integers(0, len(mixed))), data.draw(st.sampled_from(oov)))
    assert tok.decode(oov) == ""
    assert tok.decode(mixed) == tok.decode(ids)
    deltas, fin = stream(tok, {"r": {}}, {"r": mixed})["r"]
    assert "".join(deltas) == tok.decode(ids)
    assert fin.num_output_tokens == len(mixed)


# ------------------------------------------------------------------ stop strings


@st.composite
def text_and_stops(draw):
    text = draw(TEXT)
    n = draw(st.integers(1, 3))
    return text, n, draw(st.lists(st.integers(0, 10**6), min_size=3 * n, max_size=3 * n))


def pick_stops(final: str, n: int, seeds: list[int]) -> list[str]:
    """n stop strings: mostly substrings of final at random places, sometimes absent."""
    stops = []
    for i in range(n):
        a, b, c = seeds[3 * i : 3 * i + 3]
        if c % 5 == 0 or not final:
            stops.append("\x07never\x07"[: 1 + c % 7])
            continue
        start = a % len(final)
        length = 1 + b % min(6, len(final) - start)
        stops.append(final[start : start + length])
    return stops


@SETTINGS
@given(case=text_and_stops(), include=st.booleans())
def test_stop_strings(tok, case, include):
    text, n, seeds = case
    ids = tok.encode(text, add_special_tokens=False)
    if not ids:
        return
    final = tok.decode(ids)
    stops = pick_stops(final, n, seeds)
    requests = {
        "plain": {},
        "stop": {"stop": stops, "include_stop_str_in_output": include},
    }
    res = stream(tok, requests, {"plain": ids, "stop": ids})
    plain_deltas, _ = res["plain"]
    deltas, fin = res["stop"]
    joined = "".join(deltas)
    assert "".join(plain_deltas) == final

    hit = expected_stop(final, stops)
    if hit is None:
        assert joined == final
        assert fin.finish_reason == "length" and fin.stop_reason is None
    else:
        start, end, stop = hit
        assert joined == final[: end if include else start]
        assert fin.finish_reason == "stop", (stops, final)
        assert fin.stop_reason == stop
        assert fin.num_output_tokens <= len(ids)

    # Nothing emitted is taken back; the stop matcher holds back < longest stop characters.
    assert_no_take_back(deltas, joined)
    longest = max(len(s) for s in stops)
    emitted_plain, emitted = "", ""
    for k, d in enumerate(deltas):
        emitted_plain += plain_deltas[k]
        emitted += d
        if k == len(deltas) - 1 and fin.finish_reason == "stop":
            break
        assert emitted_plain.startswith(emitted)
        if k < len(deltas) - 1:  # the last step releases everything
            assert len(emitted_plain) - len(emitted) <= longest - 1, (emitted_plain, emitted)
    if FFFD not in final:
        assert FFFD not in joined


def test_stop_string_examples(tokenizer_dirs):
    tok = Tokenizer.from_dir(tokenizer_dirs["bytelevel"])
    text = "Hello STOP wörld 🦀 end"
    ids = tok.encode(text, add_special_tokens=False)
    cases = [
        (["STOP"], False, "Hello ", "STOP"),
        (["STOP"], True, "Hello STOP", "STOP"),
        (["wörld", "ö"], False, "Hello STOP w", "ö"),  # "ö" completes first
        (["o S", "lo S"], False, "Hel", "lo S"),  # same end: earlier start wins
        (["🦀"], True, "Hello STOP wörld 🦀", "🦀"),
        (["end"], False, "Hello STOP wörld 🦀 ", "end"),  # completed by the last token
    ]
    for stops, include, want, reason in cases:
        requests = {"r": {"stop": stops, "include_stop_str_in_output": include}}
        deltas, fin = stream(tok, requests, {"r": ids})["r"]
        assert "".join(deltas) == want, stops
        assert (fin.finish_reason, fin.stop_reason) == ("stop", reason)


def test_empty_stop_string_rejected(tokenizer_dirs):
    tok = Tokenizer.from_dir(tokenizer_dirs["bytelevel"])
    core = EngineCore(num_blocks=16, tokenizer=tok)
    with pytest.raises(ValueError):
        core.add_request("r", [1], stop=["ok", ""])


@pytest.mark.parametrize("kind", ["spm", "bytelevel"])
def test_long_byte_runs_stream_like_one_shot(tokenizer_dirs, kind):
    """Runs of byte tokens longer than the detokenizer's forced-emit window (16 ids)."""
    tok = Tokenizer.from_dir(tokenizer_dirs[kind])
    text = "x 🦀🦖🦕🐙🪼🫎🪿 y ꙮꙮꙮꙮꙮꙮꙮꙮ z"
    ids = tok.encode(text, add_special_tokens=False)
    deltas, _ = stream(tok, {"r": {}}, {"r": ids})["r"]
    assert "".join(deltas) == tok.decode(ids)
    assert all(FFFD not in d for d in deltas)


@pytest.mark.parametrize("skip", [True, False])
def test_stop_string_on_special_token_text(tokenizer_dirs, skip):
    """A special token's text can only match a stop string when it is not skipped."""
    tok = Tokenizer.from_dir(tokenizer_dirs["llama3"])
    ids = tok.encode("answer<|im_end|>more", add_special_tokens=False)
    requests = {"r": {"stop": ["<|im_end|>"], "skip_special_tokens": skip}}
    deltas, fin = stream(tok, requests, {"r": ids})["r"]
    if skip:
        assert "".join(deltas) == "answermore"
        assert fin.finish_reason == "length"
    else:
        assert "".join(deltas) == "answer"
        assert (fin.finish_reason, fin.stop_reason) == ("stop", "<|im_end|>")


def test_min_tokens_holds_off_stop_strings(tokenizer_dirs):
    tok = Tokenizer.from_dir(tokenizer_dirs["bytelevel"])
    ids = tok.encode("ab STOP cd STOP ef", add_special_tokens=False)
    late = len(tok.encode("ab STOP cd STOP", add_special_tokens=False))
    requests = {
        "early": {"stop": ["STOP"]},
        "held": {"stop": ["STOP"], "min_tokens": late - 1},
    }
    result = stream(tok, requests, {"early": ids, "held": ids})
    early_deltas, early = result["early"]
    held_deltas, held = result["held"]
    assert ("".join(early_deltas), early.stop_reason) == ("ab ", "STOP")
    assert (held.finish_reason, held.stop_reason) == ("stop", "STOP")
    assert "".join(held_deltas) == "ab STOP cd "
