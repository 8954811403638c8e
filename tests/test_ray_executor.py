"""The Ray executor (`distributed_executor_backend="ray"`): tensor-parallel ranks 1..N-1 as Ray
actors in a placement group, on the local Ray cluster of the Ray tests (2 CPUs): the greedy
tokens of tensor_parallel_size 2 against 1 on a GQA Llama and a Qwen2 (one KV head, replicated;
tied head), and a rank's actor killed as the group forms or mid-generation, or stopped (hung),
stopping the engine with the typed error, leaving no actor, placement group or
torch.distributed group behind."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray
import torch
import transformers
from ray_fixtures import ray_cluster
from test_tensor_parallel import (
    FAMILIES,
    GREEDY,
    LENGTHS,
    OPTIONS,
    VOCAB,
    break_mid_generation,
    check_close,
    prompts,
)
from text_fixtures import byte_level_bpe, save_model_dir
from tiny_models import save_tiny

from aieng import LLM
from aieng.executor import WorkerFailedError
from aieng.executor.ray_executor import ACTOR_PREFIX, RayExecutor

TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """4 query heads over 2 KV heads: one KV head per rank."""
    ray_cluster()
    folder = tmp_path_factory.mktemp("llama")
    save_model_dir(folder, byte_level_bpe(VOCAB))
    return save_tiny(
        transformers.LlamaConfig, transformers.LlamaForCausalLM, {"vocab_size": VOCAB}, folder
    )


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """One KV head, fewer than the ranks (replicated), the LM head tied to the embedding."""
    ray_cluster()
    folder = tmp_path_factory.mktemp("qwen2")
    save_model_dir(folder, byte_level_bpe(VOCAB))
    config_class, model_class, overrides = FAMILIES["qwen2"]
    return save_tiny(config_class, model_class, {"vocab_size": VOCAB, **overrides}, folder)


def assert_gone(actor) -> None:
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.wait_ready.remote(0), timeout=30)


def assert_nothing_left() -> None:
    """No rank actor, no placement group, no torch.distributed group outlives an engine."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    assert not [n for n in names if n.startswith(ACTOR_PREFIX)], names
    groups = ray.util.placement_group_table().values()
    assert all(g["state"] == "REMOVED" for g in groups)
    assert not torch.distributed.is_initialized()


def ray_ranks_match_one_rank(llama, lengths) -> None:
    batch = prompts(0, lengths)
    with LLM(llama, **OPTIONS) as single:
        expected = single.generate(batch, GREEDY, use_tqdm=False)
    llm = LLM(llama, tensor_parallel_size=2, distributed_executor_backend="ray", **OPTIONS)
    try:
        executor = llm.engine.executor
        assert isinstance(executor, RayExecutor)
        [actor] = executor.actors
        got = llm.generate(batch, GREEDY, use_tqdm=False)
        llm.engine.check_pool_whole()
    finally:
        llm.shutdown()
    check_close("llama on ray", expected, got)
    assert_gone(actor)
    assert_nothing_left()


def test_ray_ranks_give_the_tokens_of_one_rank(llama):
    ray_ranks_match_one_rank(llama, LENGTHS)


def test_ray_ranks_give_the_tokens_of_one_rank_on_qwen2(qwen2):
    ray_ranks_match_one_rank(qwen2, LENGTHS)


def kill_rank_once_started(killed: list) -> None:
    """Kills the first rank actor of an engine that starts, once it has started (its imports
    done), while rank 0 goes on to the rendezvous."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry["name"].startswith(ACTOR_PREFIX):
                actor = ray.get_actor(entry["name"], namespace=entry["namespace"])
                ray.get(actor.started.remote(), timeout=120)
                ray.kill(actor, no_restart=True)
                killed.append(entry["name"])
                return
        time.sleep(0.02)


def test_a_rank_killed_while_the_group_forms_fails_typed_and_leaves_nothing(llama):
    """Rank 1's actor killed as the group forms: the engine's start fails with the typed error
    (not torch's rendezvous timeout), within distributed_timeout_s and the time to say so;
    nothing is left, and a tensor-parallel engine after it in this process serves."""
    killed: list[str] = []
    killer = threading.Thread(target=kill_rank_once_started, args=(killed,), daemon=True)
    killer.start()
    start = time.monotonic()
    with pytest.raises(WorkerFailedError, match="tensor-parallel group failed at start-up"):
        LLM(
            llama,
            tensor_parallel_size=2,
            distributed_executor_backend="ray",
            distributed_timeout_s=TIMEOUT_S,
            **OPTIONS,
        )
    killer.join(timeout=10)
    assert killed, "no rank actor was started"
    assert time.monotonic() - start < 60
    assert_nothing_left()
    ray_ranks_match_one_rank(llama, [5, 12])


def break_a_rank_mid_generation(model, breaks) -> tuple[str, float]:
    """A TP=2 engine on Ray generating; `breaks(actor)` breaks rank 1 mid-generation (the
    engine then fails as test_tensor_parallel.break_mid_generation checks) -> (the engine's
    dead reason, seconds from the break to the error); no actor, placement group or torch
    group is left."""
    llm = LLM(
        model,
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        distributed_timeout_s=TIMEOUT_S,
        **OPTIONS,
    )
    [actor] = llm.engine.executor.actors
    elapsed = break_mid_generation(llm, lambda: breaks(actor))
    assert_gone(actor)
    assert_nothing_left()
    return llm.engine.dead_reason, elapsed


def test_a_killed_rank_actor_stops_the_engine_with_the_typed_error(llama):
    reason, _ = break_a_rank_mid_generation(llama, lambda actor: ray.kill(actor, no_restart=True))
    assert "rank 1's Ray actor died" in reason


def stop_the_process(actor) -> None:
    """SIGSTOP to the actor's process: it hangs, neither dead nor answering."""
    pid = ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=60)
    os.kill(pid, signal.SIGSTOP)


def test_a_hung_rank_actor_stops_the_engine_after_the_timeout(llama):
    """Rank 1's actor process stopped mid-generation: the collective times out and the engine
    ends with the typed error naming the hang."""
    reason, elapsed = break_a_rank_mid_generation(llama, stop_the_process)
    assert "hung past distributed_timeout_s" in reason
    assert TIMEOUT_S * 0.9 < elapsed < TIMEOUT_S + 30
