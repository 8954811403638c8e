"""The redesign's seams: one resolved EngineConfig, and front ends that talk to an EngineClient.

- `create_engine_config` resolves every derived value once; the runner and the engine read the
  resolved values (a checkpoint file read twice, or a value derived twice, shows up as a
  difference here).
- The server, `LLM` and the CLI never reach through the engine to its runner or its core: the
  only way in is the EngineClient Protocol (`AsyncLLMEngine` satisfies it).
"""

import ast
import asyncio
import dataclasses
from pathlib import Path

import pytest

import aieng
from aieng.config.default_model import default_model_path
from aieng.config.engine_args import EngineArgs
from aieng.config.engine_config import EngineConfig, RunnerConfig, create_engine_config
from aieng.config.model_config import ModelConfig
from aieng.engine.async_engine import AsyncLLMEngine
from aieng.engine.engine_client import EngineClient, ModelInfo
from aieng.engine.llm_engine import LLMEngine
from aieng.sampling import SamplingParams

PACKAGE = Path(aieng.__file__).resolve().parent
FRONT_ENDS = [PACKAGE / "server", PACKAGE / "cli", PACKAGE / "ray", PACKAGE / "llm.py"]
# Attributes that belong to the engine's insides: its runner, its Rust core, the engine an
# AsyncLLMEngine wraps.
INTERNALS = {"runner", "core", "engine_config"}


def _args(**options) -> EngineArgs:
    return EngineArgs(str(default_model_path()), kv_cache_memory=1 << 22, max_num_seqs=4, **options)


def test_the_config_is_resolved_once_and_frozen():
    config = create_engine_config(_args(max_model_len=64))
    assert config.device == "cpu" and config.dtype == "float32"  # 'auto' on this machine
    assert config.scheduler.max_model_len == 64
    assert config.scheduler.max_num_batched_tokens == 64 * 4  # 4 full-length sequences
    assert config.model == ModelConfig.from_pretrained(default_model_path())
    assert config.eos_token_ids and all(t < config.vocab_size for t in config.eos_token_ids)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.device = "cuda"  # type: ignore[misc]
    rank = config.for_rank(1, 1)
    assert rank.parallel.rank == 1 and rank.device == "cpu"  # the CPU has no device index


def test_the_config_keeps_no_raw_options_and_chooses_the_default_model():
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    assert "args" not in names and {"runner", "max_logprobs"} <= names
    config = create_engine_config(EngineArgs(seed=7, enforce_eager=True, max_logprobs=5))
    assert config.model_path == str(default_model_path())  # no model named: the bundled one
    assert config.runner == RunnerConfig(
        attention_backend="auto",
        enforce_eager=True,
        seed=7,
        cpu_quant_kernel=EngineArgs().cpu_quant_kernel,
        cpu_lm_head=EngineArgs().cpu_lm_head,
    )
    assert config.max_logprobs == 5


def test_an_explicit_dtype_and_a_cuda_device_resolve_without_a_gpu():
    config = create_engine_config(_args(device="cuda", dtype="half"))
    assert config.dtype == "float16" and config.uses_cuda
    assert config.for_rank(1, 1).device == "cuda:1"


def test_the_engine_reads_the_resolved_config_and_does_not_read_the_checkpoint_again(
    monkeypatch,
):
    config = create_engine_config(_args(max_model_len=96))
    reads = []
    real = ModelConfig.from_pretrained.__func__

    def counting(cls, path):
        reads.append(path)
        return real(cls, path)

    monkeypatch.setattr(ModelConfig, "from_pretrained", classmethod(counting))
    engine = LLMEngine(config)
    assert reads == []  # the runner and the loader used config.model
    assert engine.engine_config is config and engine.runner.engine_config is config
    assert engine.max_model_len == engine.runner.max_model_len == 96
    info = engine.model_info
    assert isinstance(info, ModelInfo)
    assert (info.max_model_len, info.vocab_size, info.device) == (96, config.vocab_size, "cpu")
    assert info.num_blocks == engine.runner.num_blocks and info.max_num_seqs == 4


def test_a_bad_option_is_refused_before_anything_loads(tmp_path):
    with pytest.raises(FileNotFoundError, match="model folder not found"):
        create_engine_config(EngineArgs(str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="max_model_len 100000 exceeds"):
        create_engine_config(_args(max_model_len=100_000))


def test_the_async_engine_is_an_engine_client():
    engine = LLMEngine(_args())

    async def run() -> list[str]:
        client = AsyncLLMEngine(engine)
        assert isinstance(client, EngineClient)
        client.start()
        try:
            params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
            ids = client.tokenizer.encode("And God said", add_special_tokens=True)
            texts = [out.outputs[0].text async for out in client.generate("r", ids, params)]
            assert client.model_info.max_model_len == engine.max_model_len
            assert client.stats.max_num_seqs == 4 and client.alive
            assert client.gpu_memory() is None  # on the CPU
            return texts
        finally:
            client.shutdown()

    assert "".join(asyncio.run(run()))
    assert not client_thread_alive(engine)


def client_thread_alive(engine: LLMEngine) -> bool:
    import threading

    return any(t.name == "aieng-engine" and t.is_alive() for t in threading.enumerate())


def test_shutting_down_a_client_stops_its_loop_then_releases_the_engine():
    async def run() -> AsyncLLMEngine:
        client = await asyncio.to_thread(AsyncLLMEngine.from_engine_args, _args())
        client.start()
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        outs = [out async for out in client.generate("r", [5, 6, 7], params)]
        assert outs[-1].finished
        client.shutdown()
        client.shutdown()  # idempotent
        return client

    client = asyncio.run(run())
    assert not client.alive and not client_thread_alive(client.engine)
    assert client.engine.dead_reason == "the engine was shut down"
    with pytest.raises(aieng.EngineStateError, match="shut down"):
        _ = client.engine.runner  # the model, KV cache and graphs were dropped
    assert client.engine.gpu_memory() is None


def test_a_client_never_started_releases_its_engine_at_shutdown():
    client = AsyncLLMEngine.from_engine_args(_args())
    client.shutdown()
    assert client.engine.dead_reason == "the engine was shut down"
    with pytest.raises(aieng.EngineStateError):
        _ = client.engine.runner


def _reached_internals(path: Path) -> list[str]:
    """`x.runner`, `x.core`, `x.engine_config` and `x.engine.engine` in one source file, and
    imports of the runner's module."""
    found = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            inner = node.value
            if node.attr in INTERNALS:
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
            elif (
                node.attr == "engine"
                and isinstance(inner, ast.Attribute)
                and inner.attr == "engine"
            ):
                found.append(f"{path.name}:{node.lineno} .engine.engine")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [alias.name for alias in node.names]
            if any(n.startswith(("aieng.worker.runner", "aieng.distributed")) for n in names):
                found.append(f"{path.name}:{node.lineno} imports {names}")
    return found


def test_front_ends_reach_the_engine_only_through_its_client():
    files = [f for p in FRONT_ENDS for f in ([p] if p.is_file() else sorted(p.rglob("*.py")))]
    assert len(files) > 20
    found = [hit for f in files for hit in _reached_internals(f)]
    assert found == [], "front ends reaching into the engine:\n" + "\n".join(found)


def test_the_guard_catches_a_reach_through(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(ctx):\n    return ctx.engine.engine.runner.config.vocab_size\n")
    assert len(_reached_internals(bad)) == 2  # .runner and .engine.engine


def test_the_executor_reaches_its_workers_only_through_their_methods():
    """The Worker owns its device: the executor never reads a worker's runner."""
    files = sorted((PACKAGE / "executor").rglob("*.py"))
    assert len(files) > 5
    found = [
        f"{f.name}:{node.lineno}"
        for f in files
        for node in ast.walk(ast.parse(f.read_text()))
        if isinstance(node, ast.Attribute) and node.attr == "runner"
    ]
    assert found == [], found


def test_a_worker_owns_its_device_and_describes_itself():
    from aieng.worker.worker import Worker, WorkerInfo

    worker = Worker(create_engine_config(_args(max_model_len=64)))
    assert worker.init_device() is None  # the only rank: no group to join
    worker.load_model()
    memory = worker.determine_available_memory()
    assert memory == 1 << 22  # kv_cache_memory, as given
    num_blocks = worker.num_blocks_for(memory)
    info = worker.initialize_cache(num_blocks)
    assert isinstance(info, WorkerInfo)
    # The native decoder serves the float32 model: `auto` is a bfloat16 cache.
    assert worker.runner.native is not None
    assert info.device == "cpu" and info.kv_cache_dtype == "bfloat16"
    assert num_blocks == memory // info.block_bytes
    assert set(info.load_phases) >= {"read", "kv_cache"} and "attention_backend" in info.kernels
    assert worker.runner.num_blocks == num_blocks


def test_engine_config_is_what_the_runner_takes():
    import inspect

    from aieng.worker.runner import ModelRunner

    param = inspect.signature(ModelRunner.__init__).parameters["config"]
    assert param.annotation in (EngineConfig, "EngineConfig")
