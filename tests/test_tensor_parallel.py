"""Tensor parallelism end to end on CPU (gloo, 2 ranks): greedy tokens of tensor_parallel_size=2
against tensor_parallel_size=1 on four architectures, with chunked prefill and prefix-cache hits;
the env:// launch path; workers that die or hang; start-up errors as one line.

Where the ranks' all-reduce sums in another order than one process does, a greedy token may
differ; the first divergence must then pass vLLM's logprob-closeness rule (each side's token in
the other's top logprobs). Divergences are printed (`pytest -s`) and counted in DIVERGENCES.
"""

import json
import multiprocessing
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from server_fixtures import SubprocessServer
from server_fixtures import free_port as free_tcp_port
from text_fixtures import byte_level_bpe, save_model_dir
from tiny_models import QWEN3_MOE, save_tiny

from aieng import LLM, SamplingParams
from aieng.engine.llm_engine import EngineDeadError
from aieng.executor import ExecutorError, WorkerFailedError
from aieng.executor.messages import HEAD_BYTES
from aieng.structured_outputs import StructuredOutputsParams
from aieng.worker.runner_io import NewSamplingRow

VOCAB = 384
TIMEOUT_S = 4.0  # distributed_timeout_s of the failure tests
# float32 cache on both sides: one rank runs the native decoder, whose default cache is bfloat16
OPTIONS = dict(
    block_size=4,
    kv_cache_memory=1 << 22,
    max_num_seqs=4,
    max_num_batched_tokens=16,
    kv_cache_dtype="float32",
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
LENGTHS = [1, 5, 12, 23, 37]  # past 16 tokens: chunked prefill
WIDE = 24  # requests added at once in run_batches' third batch
CHOICES = ["alpha", "beta gamma", "delta"]
DIVERGENCES: dict[str, tuple[int, int]] = {}  # family -> (sequences diverged, sequences)

# family -> (config class, model class, config overrides)
FAMILIES = {
    # 4 query heads over 2 KV heads: one KV head per rank.
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    # One KV head, fewer than the ranks: replicated; the LM head tied to the embedding.
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(num_key_value_heads=1, tie_word_embeddings=True),
    ),
    # Soft-capped attention and logits, a sliding window, (1 + w) norms.
    "gemma2": (
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        dict(
            num_hidden_layers=3,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=8,
            attn_logit_softcapping=1.5,
            final_logit_softcapping=3.0,
            pad_token_id=0,
        ),
    ),
    # 8 experts, top-2, one dense layer; per-head q/k norms, head_dim 32.
    "qwen3_moe": QWEN3_MOE,
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    built = {}
    for name, (config_cls, model_cls, overrides) in FAMILIES.items():
        folder = tmp_path_factory.mktemp(name)
        save_model_dir(folder, byte_level_bpe(VOCAB))
        built[name] = save_tiny(config_cls, model_cls, {"vocab_size": VOCAB, **overrides}, folder)
    return built


def prompts(seed: int, lengths) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def wide_params() -> list[SamplingParams]:
    """Each with its own allowed_token_ids list (pickled in full: about 1 KB a row)."""
    return [
        SamplingParams(
            temperature=0.0,
            max_tokens=2,
            ignore_eos=True,
            logprobs=5,
            allowed_token_ids=list(range(3 + i, VOCAB)),
        )
        for i in range(WIDE)
    ]


def run_batches(llm: LLM):
    """Four batches: mixed lengths (chunked prefill) with their prompts scored; repeats and a
    shared prefix (prefix-cache hits); WIDE requests at once, whose first step message needs a
    second broadcast; two requests held to a choice by a grammar. Then a one-off scoring forward
    (`runner.prompt_logprobs`)."""
    batch = prompts(0, LENGTHS)
    scored = SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=2
    )
    first = llm.generate(batch, scored, use_tqdm=False)
    repeat = [batch[-1], [*batch[-1][:24], 7, 8, 9]]
    second = llm.generate(repeat, GREEDY, use_tqdm=False)
    wide = prompts(1, [8] * WIDE)
    third = llm.generate(wide, wide_params(), use_tqdm=False)
    # A grammar's masks come from rank 0's core; the other ranks never need them.
    constrained = SamplingParams(
        temperature=0.0,
        max_tokens=16,
        logprobs=5,
        structured_outputs=StructuredOutputsParams(choice=CHOICES),
    )
    fourth = llm.generate(batch[:2], constrained, use_tqdm=False)
    assert all(o.outputs[0].text in CHOICES for o in fourth)
    outputs = first + second + third + fourth
    return outputs, llm.engine.prompt_logprobs(batch[-1], chunk_size=16)


def check_close(name: str, expected, got) -> None:
    """Identical greedy tokens, or a first divergence that passes vLLM's closeness rule."""
    diverged = 0
    for want, have in zip(expected, got, strict=True):
        a, b = want.outputs[0], have.outputs[0]
        if a.token_ids == b.token_ids:
            continue
        diverged += 1
        i = next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y)
        assert a.logprobs is not None and b.logprobs is not None, f"{name}: {a} vs {b}"
        assert a.token_ids[i] in b.logprobs[i] and b.token_ids[i] in a.logprobs[i], (
            f"{name}: prompt {want.prompt_token_ids} diverges at output token {i}: "
            f"{a.token_ids} vs {b.token_ids}"
        )
    DIVERGENCES[name] = (diverged, len(expected))
    print(f"{name}: {diverged} of {len(expected)} sequences diverged (all within the rule)")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_tp2_greedy_matches_tp1(folders, name):
    single = LLM(folders[name], **OPTIONS)
    expected, expected_scores = run_batches(single)
    llm = LLM(folders[name], tensor_parallel_size=2, **OPTIONS)
    try:
        got, scores = run_batches(llm)
        with pytest.raises(RuntimeError, match="already holds a tensor-parallel engine"):
            LLM(folders[name], **OPTIONS)
        # An engine built before the group keeps its one-rank layers: it joins no collective.
        again = single.generate(prompts(0, LENGTHS)[-2:], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [
            o.outputs[0].token_ids for o in expected[len(LENGTHS) - 2 : len(LENGTHS)]
        ]
        llm.engine.check_pool_whole()
    finally:
        llm.shutdown()
    assert [o.num_cached_tokens > 0 for o in got[len(LENGTHS) : len(LENGTHS) + 2]] == [True] * 2
    check_close(name, expected, got)
    torch.testing.assert_close(scores, expected_scores, atol=1e-4, rtol=0)
    for want, have in zip(expected[: len(LENGTHS)], got, strict=False):
        assert len(have.prompt_logprobs) == len(have.prompt_token_ids)
        for a, b in zip(want.prompt_logprobs[1:], have.prompt_logprobs[1:], strict=True):
            assert a.keys() == b.keys()
            torch.testing.assert_close(list(b.values()), list(a.values()), atol=1e-4, rtol=0)


def test_the_wide_batch_takes_the_two_broadcast_path():
    """run_batches' WIDE new sampling rows arrive in one step message larger than HEAD_BYTES."""
    rows = [
        NewSamplingRow(i, params, p)
        for i, (params, p) in enumerate(zip(wide_params(), prompts(1, [8] * WIDE), strict=True))
    ]
    assert len(pickle.dumps(rows, protocol=pickle.HIGHEST_PROTOCOL)) > HEAD_BYTES


# ---------------------------------------------------------------------- failures


def tp_children() -> list:
    """This process's tensor-parallel workers still alive (other tests' children aside)."""
    return [p for p in multiprocessing.active_children() if p.name.startswith("aieng-tp-rank")]


def gone(pid: int) -> bool:
    """No such process, or one that only waits to be reaped by someone else (Linux /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def spawned_children(parent: int) -> list[int]:
    """Processes whose parent is `parent` and that multiprocessing's spawn started."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if ppid == parent and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


def break_mid_generation(llm: LLM, breaks: Callable[[], None]) -> float:
    """Requests mid-generation on a TP=2 engine, then `breaks()` one of its ranks: steps until
    the engine raises the typed error, checks every later call raises too, shuts it down;
    -> seconds from the break to the error."""
    engine = llm.engine
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    for i, prompt in enumerate(prompts(2, [5, 9, 30])):
        engine.add_request(str(i), prompt, long)
    try:
        for _ in range(3):
            engine.step()
        breaks()
        start = time.monotonic()
        with pytest.raises(EngineDeadError) as raised:
            while engine.has_unfinished():
                engine.step()
        elapsed = time.monotonic() - start
        with pytest.raises(EngineDeadError):  # and every later call
            llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert "tensor-parallel group failed" in str(raised.value)
    return elapsed


def start_and_break(folder, sig: signal.Signals):
    """A TP=2 engine with requests mid-generation, its worker sent `sig`: steps until the
    engine raises; -> (the engine, the worker's pid, seconds from the signal to the error)."""
    llm = LLM(folder, tensor_parallel_size=2, distributed_timeout_s=TIMEOUT_S, **OPTIONS)
    [pid] = llm.engine.executor.worker_pids
    elapsed = break_mid_generation(llm, lambda: os.kill(pid, sig))
    return llm.engine, pid, elapsed


def test_a_killed_worker_ends_the_engine_at_once(folders):
    engine, pid, elapsed = start_and_break(folders["llama"], signal.SIGKILL)
    assert elapsed < TIMEOUT_S
    assert f"worker rank 1 (pid {pid}) was killed by SIGKILL" in engine.dead_reason
    assert gone(pid) and not tp_children()


def test_a_hung_worker_ends_the_engine_after_the_timeout(folders):
    engine, pid, elapsed = start_and_break(folders["llama"], signal.SIGSTOP)
    assert TIMEOUT_S * 0.9 < elapsed < TIMEOUT_S + 10  # the timeout, then stopping the worker
    assert "hung past distributed_timeout_s" in engine.dead_reason
    assert gone(pid) and not tp_children()


def test_serve_exits_nonzero_when_its_worker_dies(folders, tmp_path):
    flags = ("--tensor-parallel-size", "2", "--distributed-timeout-s", str(TIMEOUT_S))
    with SubprocessServer(folders["llama"], tmp_path / "serve.log", *flags) as server:
        [worker] = spawned_children(server.proc.pid)
        os.kill(worker, signal.SIGKILL)
        status = server.wait(timeout=TIMEOUT_S + 10)
        log = server.log
    assert status != 0
    assert f"worker rank 1 (pid {worker}) was killed by SIGKILL" in log
    assert gone(worker)


# ---------------------------------------------------------------------- engine lifetime


def test_engines_one_after_another_in_one_process(folders):
    """shutdown(), a `with` block and `del` + gc.collect() each release a tensor-parallel engine
    (its worker process, its group): engines of size 2, then 1, then 2, then 2 again, in one
    process, all giving the same tokens."""
    import gc

    folder, batch = folders["llama"], prompts(4, [5, 9])

    def tokens(llm):
        return [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]

    with LLM(folder, tensor_parallel_size=2, **OPTIONS) as llm:
        expected = tokens(llm)
        [pid] = llm.engine.executor.worker_pids
    assert gone(pid) and not tp_children()
    with pytest.raises(EngineDeadError, match="shut down"):
        llm.generate(batch, GREEDY, use_tqdm=False)
    single = LLM(folder, **OPTIONS)
    assert tokens(single) == expected
    single.shutdown()
    llm = LLM(folder, tensor_parallel_size=2, **OPTIONS)
    assert tokens(llm) == expected
    [pid] = llm.engine.executor.worker_pids
    del llm
    gc.collect()
    assert gone(pid) and not tp_children()
    llm = LLM(folder, tensor_parallel_size=2, **OPTIONS)
    try:
        assert tokens(llm) == expected
    finally:
        llm.shutdown()
        llm.shutdown()  # idempotent
    assert not tp_children()


# ---------------------------------------------------------------------- env:// (a launcher)

LAUNCHED = """
import json, sys
from aieng import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, **json.loads(sys.argv[2]))
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
outputs = llm.generate(json.loads(sys.argv[3]), params, use_tqdm=False)
print(json.dumps([o.outputs[0].token_ids for o in outputs]))
llm.shutdown()
"""


def test_processes_a_launcher_started_match_one_process(folders):
    """Two processes with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set, as torchrun starts
    them on one or several machines: rank 0 generates, rank 1 serves and exits 0."""
    folder, batch = folders["llama"], prompts(3, [4, 19, 26])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    single = LLM(folder, **OPTIONS)
    expected = [o.outputs[0].token_ids for o in single.generate(batch, params, use_tqdm=False)]
    del single
    port = str(free_tcp_port())
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        command = [sys.executable, "-c", LAUNCHED, str(folder), json.dumps(OPTIONS)]
        procs.append(
            subprocess.Popen(
                [*command, json.dumps(batch)], env=env, stdout=subprocess.PIPE, text=True
            )
        )
    try:
        outputs = [proc.communicate(timeout=90)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert [proc.returncode for proc in procs] == [0, 0]
    assert json.loads(outputs[0].strip().splitlines()[-1]) == expected
    assert outputs[1].strip() == ""


def test_a_launcher_world_size_other_than_the_tp_size_is_refused(folders, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="tensor_parallel_size 2 but the launcher started"):
        LLM(folders["llama"], tensor_parallel_size=2, **OPTIONS)


def test_a_failed_join_leaves_nothing_for_the_next_engine(folders, monkeypatch):
    """Rank 0 of a launched group whose rank 1 never comes: the rendezvous fails after
    distributed_timeout_s with the typed error, and leaves torch.distributed as it found it, so
    a tensor-parallel engine after it in this process joins its ranks. (A failed rendezvous once
    left torch's count of group names advanced: every later rank 0 here then waited for keys
    its fresh ranks never wrote, and timed out.)"""
    folder, batch = folders["llama"], prompts(5, [5, 12])
    with monkeypatch.context() as env:
        env.setenv("RANK", "0")
        env.setenv("WORLD_SIZE", "2")
        env.setenv("MASTER_ADDR", "127.0.0.1")
        env.setenv("MASTER_PORT", str(free_tcp_port()))
        with pytest.raises(WorkerFailedError, match="did not all join the group within") as raised:
            LLM(folder, tensor_parallel_size=2, distributed_timeout_s=1.0, **OPTIONS)
    assert "\n" not in str(raised.value) and "distributed_timeout_s = 1 s" in str(raised.value)
    assert not torch.distributed.is_initialized()
    with LLM(folder, **OPTIONS) as single:
        expected = single.generate(batch, GREEDY, use_tqdm=False)
    with LLM(folder, tensor_parallel_size=2, distributed_timeout_s=30.0, **OPTIONS) as llm:
        got = llm.generate(batch, GREEDY, use_tqdm=False)
    check_close("llama after a failed join", expected, got)
    assert not tp_children()


# ---------------------------------------------------------------------- start-up errors


def test_heads_the_ranks_cannot_share_are_one_line(folders):
    """4 attention heads over 3 ranks: the model constructors refuse it, on every rank; the
    driver raises one ValueError and leaves no worker behind."""
    with pytest.raises(ValueError) as raised:
        LLM(folders["llama"], tensor_parallel_size=3, **OPTIONS)
    message = str(raised.value)
    assert "tensor_parallel_size 3" in message and "\n" not in message
    assert not tp_children()


UNGUARDED = """
from aieng import LLM
LLM({folder!r}, tensor_parallel_size=2, block_size=4, kv_cache_memory=1 << 22)
"""


def test_a_worker_that_fails_before_it_starts_is_named(folders, tmp_path):
    """A script that starts an engine at its top level, unguarded: the spawned rank imports it,
    fails before it can report, and the driver says which rank died and why that happens."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED.format(folder=str(folders["llama"])))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("aieng.executor.base.WorkerFailedError: ")
    assert "worker rank 1" in last and "exited with status 1 before it could start" in last
    assert "if __name__ == '__main__':" in last


def test_a_rendezvous_port_in_use_is_one_line(folders, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setenv("MASTER_PORT", str(port))
        with pytest.raises(ExecutorError, match=f"port 127.0.0.1:{port} .* cannot be used"):
            LLM(folders["llama"], tensor_parallel_size=2, **OPTIONS)
    assert not tp_children()


@pytest.mark.parametrize("size", [0, -1])
def test_a_size_below_one_is_refused(size):
    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1"):
        LLM(tensor_parallel_size=size)
